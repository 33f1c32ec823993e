import django.core.validators
from django.db import migrations, models


class Migration(migrations.Migration):
    """An API key's share of a full fleet: priority class, weight, bound on waiting generations (issue 37)."""

    dependencies = [
        ("api", "0003_batches"),
    ]

    operations = [
        migrations.AddField(
            model_name="apikey",
            name="priority",
            field=models.CharField(
                choices=[("high", "High"), ("normal", "Normal"), ("low", "Low")], default="normal",
                help_text="Its generations' class when the fleet is full: a higher class takes the next free lane "
                "first. A request may ask for this class or a lower one (`priority`), never a higher one.",
                max_length=10),
        ),
        migrations.AddField(
            model_name="apikey",
            name="weight",
            field=models.PositiveSmallIntegerField(
                default=1, help_text="Its share of freed lanes against other keys of its class with generations "
                "waiting: a key of weight 2 gets two for each of a weight-1 key's.",
                validators=[django.core.validators.MinValueValidator(1),
                            django.core.validators.MaxValueValidator(100)]),
        ),
        migrations.AddField(
            model_name="apikey",
            name="max_waiting",
            field=models.PositiveIntegerField(
                blank=True, help_text="Generations it may have waiting for a lane in one head process; one more gets "
                "a 429 with Retry-After. Empty: FLEET_MAX_WAITING_PER_KEY; 0: unbounded.", null=True),
        ),
    ]
