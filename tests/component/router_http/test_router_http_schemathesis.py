"""Schemathesis against the front end's own /openapi.json (over the fake scheduler): every phase
(examples, coverage, positive and negative fuzzing, stateful links), every built-in check, and the
token-limit oracle of tests/helpers/schemathesis_hooks.py in place of `positive_data_acceptance`.
Once open (every phase), once with API keys (fuzzing and stateful only, to keep the suite short:
requests without the key must get the documented 401).

A short run here; `make fuzz` runs it with many more examples (PDCLUSTER_FUZZ_EXAMPLES).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from router.http import ServingInfo, create_app
from router.http.keys import load_key_file
from router.tokenizer import Tokenizer
from tests.helpers.fake_scheduler import FakeScheduler
from tests.helpers.fuzz import fuzz_examples, fuzz_seed
from tests.helpers.router_http import serve, write_word_tokenizer

ROOT = Path(__file__).resolve().parents[3]
INFO = ServingInfo(model_id="tiny-words", max_input_tokens=16, max_total_tokens=40, default_max_new_tokens=8)
KEY = "sk-fuzz-0123456789abcdef"


@pytest.fixture(scope="module")
def words(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_word_tokenizer(Path(tmp_path_factory.mktemp("words")))


@pytest.fixture(params=["open", "keys"])
def served(request: pytest.FixtureRequest, words: Path, tmp_path: Path) -> Iterator[tuple[str, list[str]]]:
    """(base URL, extra schemathesis arguments)."""
    keys = None
    extra: list[str] = []
    if request.param == "keys":
        (tmp_path / "keys.txt").write_text(f"{KEY} name=fuzz\n")
        keys = load_key_file(tmp_path / "keys.txt")
        extra = ["-H", f"Authorization: Bearer {KEY}", "--phases", "examples,fuzzing,stateful"]
    app = create_app(FakeScheduler(), Tokenizer.from_model_dir(words), INFO,
                     lambda: (b"pdcluster_queue_depth 0.0\n", "text/plain; version=0.0.4"), keys)
    with serve(app) as url:
        yield url, extra


def test_schemathesis_finds_nothing(served: tuple[str, list[str]], words: Path, tmp_path: Path) -> None:
    url, extra = served
    seed = fuzz_seed()
    args = [
        str(Path(sys.executable).parent / "schemathesis"), "run", f"{url}/openapi.json",
        "--max-examples", str(fuzz_examples(20)), "--exclude-checks", "positive_data_acceptance",
        "--workers", "1", "--report-dir", str(tmp_path / "report"), *extra,
        *(["--seed", str(seed)] if seed is not None else []),
    ]
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "tests.helpers.schemathesis_hooks",
           "PDCLUSTER_ST_MODEL_DIR": str(words), "PDCLUSTER_ST_URL": url, "NO_COLOR": "1"}
    run = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, check=False)
    out = run.stdout + run.stderr
    assert run.returncode == 0 and "No issues found" in out, out[-12000:]
    generated = int(re.search(r"(\d+) generated", out).group(1))  # type: ignore[union-attr]
    assert generated >= 100, out[-3000:]  # not a vacuous run
    phases = ("Examples", "Fuzzing", "Stateful") if extra else ("Examples", "Coverage", "Fuzzing", "Stateful")
    for phase in phases:
        assert re.search(rf"✅ {phase}", out), (phase, out[-3000:])
    links = re.search(r"API Links:\s+(\d+) covered / 5 selected / 5 total", out)
    assert links is not None and int(links.group(1)) >= 3, out[-3000:]  # stateful sequences ran
    print(f"schemathesis: {generated} cases, no failures")
