# Issue 11 part 5: each registry model's tokenizer fingerprint (rows added before it are filled in lazily, by
# nodes.tokenizers.model_tokenizer, the first time a node registers the model or a generation needs it).

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('nodes', '0005_deployment_nodemodel'),
    ]

    operations = [
        migrations.AddField(
            model_name='model',
            name='tokenizer',
            field=models.CharField(blank=True, editable=False, help_text='The sha256 fingerprint of its tokenizer (nodes.agent.vocab); blank until first needed.', max_length=64),
        ),
    ]
