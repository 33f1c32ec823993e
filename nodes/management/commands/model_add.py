"""`manage.py model_add PATH --name NAME [--base MODEL]`: add a GGUF model (or a LoRA adapter of MODEL) on the head to
the model registry."""

from django.core.management.base import BaseCommand, CommandError

from nodes.registry import RegistryError, model_add


class Command(BaseCommand):
    help = "Add a GGUF model file to the head's registry; nodes then pull it with `node_join --model NAME`."

    def add_arguments(self, parser):
        parser.add_argument("path", help="the .gguf file on this machine (copied into $FLEET_HOME/blobs/)")
        parser.add_argument("--name", required=True, help="the model's name on the fleet")
        parser.add_argument("--base", default="", help="for a LoRA adapter or an image projector (mmproj): the "
                            "registry model it belongs to (nodes serving that model load it)")

    def handle(self, *args, **options):
        try:
            model = model_add(path=options["path"], name=options["name"], base=options["base"])
        except (RegistryError, OSError) as exc:
            raise CommandError(str(exc), returncode=2) from None
        if model.is_adapter:
            self.stdout.write(f"LoRA adapter {model.name!r} of {model.base.name!r} added: {model.size:,} bytes, "
                              f"sha256 {model.sha256}.\nEvery node serving {model.base.name!r} loads it; clients "
                              f"ask for model {model.base.name}:{model.name}\n")
            return
        if model.is_attachment:
            self.stdout.write(f"Image projector {model.name!r} of {model.base.name!r} added: {model.size:,} bytes, "
                              f"sha256 {model.sha256}.\nDeployments of {model.base.name!r} load it; on a node: "
                              f"node_join <head> --model {model.base.name} --mmproj {model.name}\n")
            return
        self.stdout.write(
            f"Model {model.name!r} added: {model.architecture}, {model.quantization}, {model.size:,} bytes, "
            f"trained context {model.context_length:,} tokens, {model.kv_bytes_per_token:,} KV bytes a token, "
            f"sha256 {model.sha256}.\nOn a node: python manage.py node_join <head> --model {model.name}\n")
