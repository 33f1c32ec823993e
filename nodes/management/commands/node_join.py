"""`manage.py node_join [head-host:port] --model <path|id> --token ...`: serve a model for the fleet.

The node side is Django-free (nodes.agent); this command only parses the flags and reports errors as one line
on stderr with exit status 2.
"""

import os
import sys

from django.conf import settings
from django.core.management.base import BaseCommand

from nodes.agent.main import NodeOptions, run_node
from nodes.agent.models import ModelNotFound, is_registry_name, resolve_model, resolve_speech_model
from nodes.agent.replicas import ReplicaConfigError, cpu_groups, gpu_groups


def _gigabytes(value: str) -> int:
    """--memory-budget GB (a decimal number, e.g. 12 or 0.5) as bytes."""
    import argparse
    import math

    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of GB (e.g. 12 or 0.5)") from None
    if not math.isfinite(number) or number <= 0:
        raise argparse.ArgumentTypeError(f"{value!r} must be a number of GB above 0")
    return int(number * 1e9)


def _positive_int(value: str) -> int:
    import argparse

    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"{value!r} must be at least 1")
    return number


def _layers(value: str) -> int:
    import argparse

    if not value.isdigit():
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of layers (0 or more)")
    return int(value)


def _shares(value: str) -> tuple[float, ...]:
    import argparse

    try:
        shares = tuple(float(part) for part in value.split(","))
    except ValueError:
        shares = ()
    if not shares or any(not share >= 0 for share in shares) or not any(shares):
        raise argparse.ArgumentTypeError(f"{value!r} is not a list of GPU shares such as 3,1 (numbers, 0 or more)")
    return shares


def _label(value: str) -> tuple[str, str]:
    import argparse
    import re

    key, sep, label = value.partition("=")
    if not sep or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,62}", key) or len(label) > 200:
        raise argparse.ArgumentTypeError(f"{value!r} is not KEY=VALUE (a key of letters, digits, '.', '_', '/', '-')")
    return key, label


def _lora(value: str) -> tuple[str, str]:
    """--lora NAME=PATH (or PATH: named for its file) -> (name, path)."""
    import argparse
    import re
    from pathlib import Path

    name, sep, path = value.partition("=")
    if not sep:
        name, path = Path(value).stem, value
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}", name):
        raise argparse.ArgumentTypeError(f"{name!r} is not an adapter name (letters, digits, '.', '_', '-')")
    if not Path(path).is_file():
        raise argparse.ArgumentTypeError(f"no LoRA adapter file at {path}")
    return name, str(Path(path).resolve())


def _one_line_error(message: str) -> None:
    sys.stderr.write(f"node_join: {message} (see `manage.py node_join --help`)\n")
    sys.exit(2)


class Command(BaseCommand):
    help = "Join this machine to a Fleet head and serve a GGUF model with llama.cpp."
    requires_system_checks = []
    requires_migrations_checks = False

    def create_parser(self, prog_name, subcommand, **kwargs):
        parser = super().create_parser(prog_name, subcommand, **kwargs)
        if parser.called_from_command_line:
            parser.error = _one_line_error  # argparse's usage block plus a line becomes one clear line
        return parser

    def add_arguments(self, parser):
        parser.add_argument("head", nargs="?", help="head address host:port (default: find it by mDNS)")
        parser.add_argument("--model", default="",
                            help="a .gguf path, a bundled model id (smollm2), or the name of a model in the head's "
                                 "registry (pulled into $FLEET_HOME/models/ unless this node has it); may be left out "
                                 "when --transcribe names a speech model to serve alone")
        parser.add_argument("--token", help="fleet token <id>.<secret> (kept in $FLEET_HOME/fleet/token); visible "
                                            "in `ps`: prefer --token-file or $FLEET_TOKEN")
        parser.add_argument("--token-file", metavar="PATH",
                            help="read the fleet token from this file (kept, as --token is)")
        parser.add_argument("--max-context", type=_positive_int,
                            help="per-lane context window in tokens (default: sized for this device's free memory, "
                                 "at most the model's trained context)")
        parser.add_argument("--max-batch", type=_positive_int, default=8, help="lanes: generations at once (8)")
        parser.add_argument("--identity", help="the node's name on the fleet (default: host name)")
        parser.add_argument("--label", type=_label, action="append", default=[], metavar="KEY=VALUE",
                            help="a label the head keeps for this node, e.g. gpu=a100 (repeat for more)")
        parser.add_argument("--model-name", help="the model's name on the fleet (default: its own)")
        parser.add_argument("--offline", action="store_true",
                            help="no mDNS discovery (the head address is required) and no model pull: a registry "
                                 "model must already be on this node")
        parser.add_argument("--park", action="store_true", help="keep prompt prefixes on disk to start warm")
        parser.add_argument("--replicas", type=_positive_int, default=1, help="engine workers on this node")
        parser.add_argument("--gpus", help='GPUs to split among replicas: "0,1,2,3" or groups "0,1;2,3"')
        parser.add_argument("--accept-new-head", action="store_true",
                            help="forget the head key pinned at the first join and pin the one the head shows now")
        parser.add_argument("--batch-invariant", action="store_true",
                            help="flash attention off: a greedy generation's tokens never depend on what shares its "
                                 "batch (slower; requests with batch_invariant go only to such nodes)")
        parser.add_argument("--lora", type=_lora, action="append", default=[], metavar="NAME=PATH",
                            help="load a GGUF LoRA adapter for the model (repeat for more); requests pick it as model "
                                 "MODEL:NAME or with the lora field")
        parser.add_argument("--mmproj", metavar="PATH|NAME",
                            help="the model's multimodal projector (a GGUF mmproj file, or the name of one in the "
                                 "head's registry, pulled like a model): chats may then send images (capability "
                                 "vision), read through llama.cpp's mtmd")
        parser.add_argument("--memory-budget", type=_gigabytes, default=0, metavar="GB",
                            help="the most memory this node's models may hold, weights and KV (default: the "
                                 "device's free memory); the head loads on-demand models here within it")
        parser.add_argument("--no-on-demand", action="store_true",
                            help="the head never loads a registry model here on demand (deployments still do)")
        parser.add_argument("--cpu", action="store_true",
                            help="run on the CPU although this host has a GPU (without it, a GPU the llama.cpp build "
                                 "cannot use stops the node with the `make node GPU=...` that fixes it)")
        parser.add_argument("--gpu-layers", type=_layers, metavar="N",
                            help="offload the model's first N layers to the GPU, the rest on the CPU (default: all "
                                 "when the build sees a GPU; llama.cpp counts the output layer as one)")
        parser.add_argument("--split-mode", choices=["none", "layer", "row"], default="",
                            help="one engine worker over several GPUs: layer (llama.cpp's default) spreads layers and "
                                 "KV cache over them, row splits each layer's tensors too, none keeps the model on one "
                                 "GPU (docs/operations.md, *Several GPUs*)")
        parser.add_argument("--tensor-split", type=_shares, default=(), metavar="SHARES",
                            help="each GPU's share of the model, in the build's order, e.g. 3,1 (default: by free "
                                 "memory)")
        parser.add_argument("--transcribe", metavar="SPEECH_MODEL",
                            help="also serve /v1/audio/transcriptions with this speech model: whisper-tiny.en (the "
                                 "bundled one) or a CTranslate2 Whisper model folder; run by faster-whisper in the "
                                 "engine worker")

    def handle(self, *args, **options):
        if not options["model"] and not options["transcribe"]:
            sys.stderr.write("node_join: give --model (a text model), --transcribe (a speech model), or both\n")
            sys.exit(2)
        try:
            # a registry name is asked of the head, or found in $FLEET_HOME
            if options["model"] and not is_registry_name(options["model"]):
                resolve_model(options["model"])
            gpu_groups(options["replicas"], options["gpus"])
            cpu_groups(options["replicas"])
            if options["transcribe"]:
                resolve_speech_model(options["transcribe"])
        except (ModelNotFound, ReplicaConfigError) as exc:
            sys.stderr.write(f"node_join: {exc}\n")
            sys.exit(2)
        if options["mmproj"] and not os.path.isfile(options["mmproj"]) and not is_registry_name(options["mmproj"]):
            sys.stderr.write(f"node_join: --mmproj: no file at {options['mmproj']!r} (give the model's GGUF "
                             "multimodal projector)\n")
            sys.exit(2)
        if options["mmproj"] and not options["model"]:
            sys.stderr.write("node_join: --mmproj needs --model: the projector belongs to a text model\n")
            sys.exit(2)
        if options["cpu"] and options["gpu_layers"]:
            sys.stderr.write("node_join: --cpu offloads nothing; leave out --gpu-layers, or --cpu\n")
            sys.exit(2)
        if options["offline"] and not options["head"]:
            sys.stderr.write("node_join: --offline needs the head's address (host:port)\n")
            sys.exit(2)
        token, source = options["token"], "--token"
        if options["token_file"] and not token:
            token, source = _read_token_file(options["token_file"]), f"--token-file {options['token_file']}"
        code = run_node(NodeOptions(
            head=options["head"], model=options["model"], token=token, token_source=source,
            max_context=options["max_context"], max_batch=options["max_batch"], identity=options["identity"],
            model_name=options["model_name"], offline=options["offline"], park=options["park"],
            labels=dict(options["label"]), adapters=dict(options["lora"]),
            replicas=options["replicas"], gpus=options["gpus"], accept_new_head=options["accept_new_head"],
            batch_invariant=options["batch_invariant"], home=settings.FLEET_HOME, transcribe=options["transcribe"],
            mmproj=options["mmproj"], memory_budget=options["memory_budget"], on_demand=not options["no_on_demand"],
            cpu=options["cpu"], gpu_layers=options["gpu_layers"], split_mode=options["split_mode"],
            tensor_split=options["tensor_split"],
        ))
        if code:
            sys.exit(code)


def _read_token_file(path: str) -> str:
    """The token in `path` (its first line); one line and exit status 2 when it cannot be read."""
    try:
        with open(path, encoding="utf-8") as file:
            return file.readline().strip()
    except (OSError, UnicodeDecodeError) as exc:
        sys.stderr.write(f"node_join: --token-file {path!r} cannot be read: {exc.strerror or exc}\n")
        sys.exit(2)
