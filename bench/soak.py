"""A chaos soak: two head processes, four mock-engine nodes, many clients, nodes killed and a head restarted.

    .venv/bin/python bench/soak.py [--seconds 600] [--clients 50]

Needs DATABASE_URL (PostgreSQL) and REDIS_URL, as the heads share both. One node is SIGKILLed and restarted every
20 s, and the second head is restarted twice: drained (SIGTERM, started again), then SIGKILLed under load and
started again (every node links both heads; the killed head's streams in flight are its cost, counted apart in
`killed_with_head`, and the other head's must lose nothing); see tests/chaos.py, which tests/test_soak.py runs for
60 s. Writes bench/results/soak.json as {"seconds", "requests", "completed", "errors": {code: count}, "failovers",
"lost_tokens", "duplicated_tokens", "records_missing", "records_duplicated", "node_back_s_max",
"killed_with_head"} and prints the details of anything that went wrong.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.chaos import SoakConfig, run_soak  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=600.0)
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--details", type=Path, default=None, help="also write the details (problems, timings) here")
    args = parser.parse_args()
    if not os.environ.get("REDIS_URL") or not os.environ.get("DATABASE_URL", "").startswith("postgres"):
        print("bench/soak.py: set REDIS_URL and a PostgreSQL DATABASE_URL (the head processes share both)",
              file=sys.stderr)
        return 2
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "fleet.settings")
    workdir = Path(tempfile.mkdtemp(prefix="fleet-soak-"))
    report = run_soak(SoakConfig(seconds=args.seconds, clients=args.clients), workdir)
    out = ROOT / "bench" / "results" / "soak.json"
    out.write_text(json.dumps(report.summary, indent=2) + "\n")
    if args.details:
        args.details.write_text(json.dumps(report.details, indent=2, default=str) + "\n")
    print(json.dumps(report.summary, indent=2))
    print(json.dumps({k: v for k, v in report.details.items() if k not in ("token_problems", "record_problems")},
                     indent=2, default=str)[:6000])
    for name in ("token_problems", "record_problems"):
        for problem in report.details[name][:5]:
            print(name, json.dumps(problem, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
