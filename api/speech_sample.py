"""A WAV of speech made here, for trying /v1/audio/transcriptions (`manage.py sample_wav`) and for the tests: eSpeak
NG (the `espeakng-loader` wheel ships its library and voices) speaks a sentence into a 16 kHz mono WAV through its C
API. No model or recording is downloaded. Django-free: the node-side tests import it too."""

from __future__ import annotations

import ctypes
import wave
from pathlib import Path

import numpy as np

# The README's sentence; whisper tiny.en hears it (tests/speech.py lists the words it hears).
SENTENCE = "Hello world. This is a test of the fleet. The weather today is sunny and warm."

AUDIO_OUTPUT_SYNCHRONOUS = 2
ESPEAK_RATE = 1  # espeakRATE: words a minute
RATE = 16_000

_Callback = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.c_void_p)


def speak(text: str, path: Path, words_per_minute: int = 130) -> Path:
    """Write `text` spoken in US English to `path` (16-bit PCM, 16 kHz, mono). ImportError without espeakng-loader."""
    import espeakng_loader

    lib = ctypes.cdll.LoadLibrary(espeakng_loader.get_library_path())
    rate = lib.espeak_Initialize(AUDIO_OUTPUT_SYNCHRONOUS, 0, espeakng_loader.get_data_path().encode(), 0)
    chunks: list[np.ndarray] = []

    def collect(samples, count, _events) -> int:
        if count > 0:
            chunks.append(np.ctypeslib.as_array(samples, shape=(count,)).copy())
        return 0

    callback = _Callback(collect)  # kept referenced until synthesis is over
    lib.espeak_SetSynthCallback(callback)
    lib.espeak_SetVoiceByName(b"en-us")
    lib.espeak_SetParameter(ESPEAK_RATE, words_per_minute, 0)
    data = text.encode()
    lib.espeak_Synth(data, len(data) + 1, 0, 0, 0, 0, None, None)
    lib.espeak_Synchronize()
    pcm = np.concatenate(chunks).astype(np.float32)
    at = np.arange(len(pcm) * RATE // rate) * rate / RATE  # resampled by linear interpolation
    write_wav(path, np.interp(at, np.arange(len(pcm)), pcm).astype(np.int16))
    return path


def write_wav(path: Path, samples: np.ndarray) -> Path:
    with open(path, "wb") as file, wave.open(file, "wb") as out:  # a path it cannot open: one OSError, no warning
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(RATE)
        out.writeframes(samples.astype(np.int16).tobytes())
    return path
