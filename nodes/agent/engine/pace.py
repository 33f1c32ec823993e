"""What an engine measures of its own speed for the head's load cost: how fast it reads prompt tokens, and how much
each running generation slows one decode step. Both come from the timings of the steps it runs anyway (a few
arithmetic operations a step, no extra decode); the node reports them in its heartbeat (`prefill_tps`,
`decode_slowdown_ms`), and placement turns them into the prompt tokens one more running generation is worth.
"""

from __future__ import annotations

# A step reading fewer prompt tokens than this says more about a step's fixed cost than about reading speed.
MIN_PREFILL_TOKENS = 32
PREFILL_DECAY = 0.95  # per measured prefill step: the rate follows the last few dozen reads
DECODE_WINDOW = 256  # a lane count's step time is the mean of about its last this many steps
DECODE_WEIGHT_CAP = 64  # samples per lane count that weigh in the slope
SPIKE, MAX_SPIKES = 1.5, 32  # a step this much slower than its lane count's mean is left out, this many in a row


class Pace:
    """Decode steps' duration per number of decoding lanes, and the time prefill adds on top of them.

    The slowdown is the least-squares slope of step time over decoding lanes (0 until two lane counts were seen);
    the prefill rate is prompt tokens over the time a step spent beyond the decode part it also carried.
    """

    def __init__(self) -> None:
        self._decode: dict[int, tuple[float, int, int]] = {}  # decoding lanes -> (step seconds, samples, spikes)
        self._prefill_s = 0.0
        self._prefill_tokens = 0.0

    def step(self, decoding: int, prefill_tokens: int, seconds: float) -> None:
        if not prefill_tokens:
            if decoding:
                self._decode_step(decoding, seconds)
            return
        if prefill_tokens < MIN_PREFILL_TOKENS:
            return
        spent = max(seconds - (self._decode_s(decoding) if decoding else 0.0), 0.0)
        self._prefill_s = PREFILL_DECAY * self._prefill_s + spent
        self._prefill_tokens = PREFILL_DECAY * self._prefill_tokens + prefill_tokens

    def _decode_step(self, decoding: int, seconds: float) -> None:
        # A step that shared the cores with another process is slow by chance, never fast: such a spike is left out
        # (unless they keep coming: then the machine is slower now), and the rest are averaged, so the small
        # difference a lane makes (1% of a GPU's step) stands out of the timer's jitter.
        mean, n, spikes = self._decode.get(decoding, (seconds, 0, 0))
        if n and seconds > SPIKE * mean and spikes < MAX_SPIKES:
            self._decode[decoding] = (mean, n, spikes + 1)
            return
        n += 1
        self._decode[decoding] = (mean + (seconds - mean) / min(n, DECODE_WINDOW), n, 0)

    def prefill_tps(self) -> float:
        return round(self._prefill_tokens / self._prefill_s, 1) if self._prefill_s > 0 else 0.0

    def decode_slowdown_ms(self) -> float:
        fit = self._fit()
        return round(max(fit[1], 0.0) * 1000, 3) if fit is not None else 0.0

    def _fit(self) -> tuple[float, float] | None:
        """(intercept, slope) of step seconds over decoding lanes, each lane count weighted by its samples."""
        if len(self._decode) < 2:
            return None
        rows = [(lanes, mean, min(n, DECODE_WEIGHT_CAP)) for lanes, (mean, n, _) in self._decode.items()]
        w = sum(r[2] for r in rows)
        mx = sum(r[0] * r[2] for r in rows) / w
        my = sum(r[1] * r[2] for r in rows) / w
        sxx = sum(r[2] * (r[0] - mx) ** 2 for r in rows)
        slope = sum(r[2] * (r[0] - mx) * (r[1] - my) for r in rows) / sxx
        return my - slope * mx, slope

    def _decode_s(self, decoding: int) -> float:
        """What a step with this many decoding lanes takes without prefill: measured, else from the fit."""
        if decoding in self._decode:
            return self._decode[decoding][0]
        fit = self._fit()
        if fit is not None:
            return max(fit[0] + fit[1] * decoding, 0.0)
        return next(iter(self._decode.values()))[0] if self._decode else 0.0
