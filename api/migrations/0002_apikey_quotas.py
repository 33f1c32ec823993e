from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ("api", "0001_initial"),
    ]

    operations = [
        migrations.AddField(
            model_name="apikey",
            name="requests_per_minute",
            field=models.PositiveIntegerField(blank=True, help_text="Requests a minute on /v1, /api and the websocket. Empty: FLEET_QUOTA_REQUESTS_PER_MINUTE; 0: unlimited.", null=True),
        ),
        migrations.AddField(
            model_name="apikey",
            name="tokens_per_minute",
            field=models.PositiveIntegerField(blank=True, help_text="Uncached prompt tokens plus completion tokens a minute. Empty: FLEET_QUOTA_TOKENS_PER_MINUTE; 0: unlimited.", null=True),
        ),
        migrations.AddField(
            model_name="apikey",
            name="tokens_per_day",
            field=models.PositiveBigIntegerField(blank=True, help_text="Uncached prompt tokens plus completion tokens a day (UTC). Empty: FLEET_QUOTA_TOKENS_PER_DAY; 0: unlimited.", null=True),
        ),
        migrations.AddField(
            model_name="apikey",
            name="concurrent_streams",
            field=models.PositiveIntegerField(blank=True, help_text="Generations running at once. Empty: FLEET_QUOTA_CONCURRENT_STREAMS; 0: unlimited.", null=True),
        ),
    ]
