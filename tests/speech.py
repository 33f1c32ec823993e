"""Speech the transcription tests make themselves, as `manage.py sample_wav` does (api/speech_sample.py): eSpeak NG
speaks a sentence into a 16 kHz mono WAV. No model or recording is downloaded."""

from __future__ import annotations

import re

from api.speech_sample import RATE, SENTENCE, speak, write_wav

__all__ = ["RATE", "SENTENCE", "WORDS", "heard", "speak", "write_wav"]

# The words of SENTENCE that whisper tiny.en hears (checked by hand). A test asks for all but one of them: whisper's
# int8 kernels on several threads do not always round alike, and a borderline word may come out otherwise ("whether"
# for "weather").
WORDS = {"test", "fleet", "weather", "sunny", "warm"}


def heard(text: str) -> bool:
    """Whether a transcript has the spoken WORDS, all but one at most."""
    return len(WORDS - set(re.findall(r"[a-z]+", text.lower()))) <= 1
