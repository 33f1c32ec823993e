"""A real node process on the mock engine, for live tests that need a fast, deterministic node (the fuzzers).

`python -m tests.mock_node HEAD IDENTITY HOME PARAMS_JSON` runs `nodes.agent.main.run_node` as `node_join` does,
with the mock engine's knobs (nodes.agent.engine.mock.MockParams) instead of a GGUF model. It joins with the head's
own local token (FLEET_LOCAL_NODE_TOKEN, which tests.live.make_head sets), as `manage.py up`'s node does.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

from tests.live import PYTHON, ROOT, Head, NodeProc


def start_mock_node(head: Head, identity: str = "mock-node", *, model: str = "smollm2", lanes: int = 8,
                    options: dict | None = None, **params) -> NodeProc:
    """`options`: more NodeOptions fields (memory_budget, on_demand, labels); `params`: the mock engine's knobs."""
    home = head.home / f"node-{identity}"
    log_path = head.home / f"node-{identity}-{uuid.uuid4().hex[:4]}.log"
    log = open(log_path, "ab")  # noqa: SIM115 - the child owns it
    proc = subprocess.Popen(
        [PYTHON, "-m", "tests.mock_node", head.address, identity, str(home), json.dumps(params), model, str(lanes),
         json.dumps(options or {})],
        cwd=ROOT, env=head.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    return NodeProc(proc, log_path)


def main(argv: list[str]) -> int:
    from nodes.agent.main import NodeOptions, run_node

    head, identity, home, params, model, lanes, *more = argv
    options = json.loads(more[0]) if more else {}
    return run_node(NodeOptions(**{"head": head, "model": model, "identity": identity, "offline": True,
                                   "home": Path(home), "max_batch": int(lanes), "mock": json.loads(params),
                                   **options}))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
