"""`manage.py sample_wav [PATH] [--text T]`: speak a sentence into a WAV, to try /v1/audio/transcriptions with."""

from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from api.speech_sample import SENTENCE, speak


class Command(BaseCommand):
    help = "Write a WAV of a sentence spoken by eSpeak NG (16 kHz mono), for the README's transcription example."

    def add_arguments(self, parser):
        parser.add_argument("path", nargs="?", default="sample.wav", help="where to write it (sample.wav)")
        parser.add_argument("--text", default=SENTENCE, help="what it says (a sentence about the fleet)")

    def handle(self, *args, **options):
        path = Path(options["path"])
        try:
            speak(options["text"], path)
        except ImportError:
            raise CommandError("sample_wav needs eSpeak NG's wheel: pip install espeakng-loader (make install has it)",
                               returncode=2) from None
        except OSError as exc:
            raise CommandError(f"cannot write {path}: {exc.strerror or exc}", returncode=2) from None
        self.stdout.write(f"Wrote {path}: {options['text']!r}, spoken.\n")
