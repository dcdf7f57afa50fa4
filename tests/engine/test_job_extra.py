"""The job commands' store client is an extra (``multinode``): without it everything else
imports and runs, and ``cuinterpose job`` says what to install."""

from __future__ import annotations

import subprocess
import sys

# etcd3gw made unimportable, as in an installation without the extra.
WITHOUT_EXTRA = "import sys; sys.modules['etcd3gw'] = None\n"


def run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", WITHOUT_EXTRA + code], capture_output=True, text=True, check=False
    )


def test_the_engine_and_the_cli_import_without_the_extra() -> None:
    done = run(
        "import cuinterpose.engine, cuinterpose.engine.agent, cuinterpose.cli\n"
        "cuinterpose.cli.build_parser()\n"
        "assert not any(m.startswith('etcd3gw') and sys.modules[m] for m in sys.modules)\n"
    )
    assert done.returncode == 0, done.stderr


def test_the_job_verbs_say_which_extra_they_need() -> None:
    done = run(
        "from cuinterpose.cli import main\n"
        "raise SystemExit(main(['job', 'status', '--job', 'j', '--store', 'http://h:1']))\n"
    )
    assert done.returncode == 1, done.stderr
    assert "pip install 'cuinterpose[multinode]'" in done.stderr, done.stderr
    # One line, no traceback.
    assert done.stderr.strip().splitlines() == [
        "cuinterpose job status: needs the multinode extra (etcd3gw): "
        "pip install 'cuinterpose[multinode]'"
    ], done.stderr


def test_the_job_verbs_help_needs_no_extra() -> None:
    for verb in ("suspend", "resume", "recover", "status"):
        done = run(
            "from cuinterpose.cli import main\n"
            f"raise SystemExit(main(['job', '{verb}', '--help']))\n"
        )
        assert done.returncode == 0, done.stderr
        assert "--store-credentials" in done.stdout and "Traceback" not in done.stderr
    done = run("from cuinterpose.cli import main\nraise SystemExit(main(['job', '--help']))\n")
    assert done.returncode == 0 and "cuinterpose job recover" in done.stdout, done


def test_the_job_verbs_help_tells_the_jobs_own_exits() -> None:
    done = run(
        "from cuinterpose.cli import main\nraise SystemExit(main(['job', 'suspend', '--help']))\n"
    )
    assert "`cuinterpose job recover ...`" in done.stdout, done.stdout
    assert "`cuinterpose recover ...`" not in done.stdout, done.stdout


def test_the_readme_lists_every_verb() -> None:
    import re
    from pathlib import Path

    from cuinterpose.cli import _VERBS

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = readme.split("All the verbs:", 1)[1].split("\n\n", 2)[1]
    listed = set(re.findall(r"^    cuinterpose ([a-z-]+)", block, re.M))
    assert set(_VERBS) <= listed, sorted(set(_VERBS) - listed)
    for verb in ("job suspend", "job resume", "job recover", "job status", "criu check"):
        assert f"cuinterpose {verb}" in block, verb
