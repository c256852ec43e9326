"""The repository's CI workflows parse and run the README's own commands (nothing can run
GitHub's runners here, so this is what can be checked: the files say the right things)."""
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()


def _workflow(name: str) -> dict:
    data = yaml.safe_load((REPO / ".github" / "workflows" / name).read_text())
    data["on"] = data.pop(True, data.get("on"))  # YAML 1.1 reads the key `on` as True
    return data


def _runs(job: dict) -> list[str]:
    return [step["run"] for step in job["steps"] if "run" in step]


def _installs_the_pins(runs: list[str]) -> bool:
    return any("pip install" in r and "-r requirements.txt" in r for r in runs)


def test_the_test_workflow_runs_ci_run_on_every_push_and_pull_request():
    flow = _workflow("ci.yml")
    assert set(flow["on"]) == {"push", "pull_request"}
    job = flow["jobs"]["test"]
    runs = _runs(job)
    assert runs[-1] == ".ci/run" and _installs_the_pins(runs)
    assert job["container"].startswith("python:3.11-bookworm")  # Debian: apt's chromium
    ci_run = (REPO / ".ci" / "run").read_text().strip().splitlines()
    assert ci_run[-1] == "python -m pytest" and "python -m pytest" in README


def test_the_book_workflow_builds_with_the_readme_command_and_deploys_main_only():
    flow = _workflow("book.yml")
    build = flow["jobs"]["build"]
    runs = _runs(build)
    assert "bash scripts/build_book.sh" in runs and "bash scripts/build_book.sh" in README
    assert _installs_the_pins(runs)
    upload = [s for s in build["steps"] if s.get("uses", "").startswith("actions/upload-pages-artifact")]
    assert upload and upload[0]["with"]["path"] == "_build/html"
    deploy = flow["jobs"]["deploy"]
    assert deploy["needs"] == "build" and "refs/heads/main" in deploy["if"]
    assert any(s.get("uses", "").startswith("actions/deploy-pages") for s in deploy["steps"])
    assert flow["permissions"]["pages"] == "write" and flow["permissions"]["id-token"] == "write"


def test_binder_and_the_cpu_install_take_torchs_cpu_build_and_the_same_pins():
    for path in ("binder/requirements.txt", "requirements-cpu.txt"):
        lines = [l for l in (REPO / path).read_text().splitlines() if l and not l.startswith("#")]
        assert "--extra-index-url https://download.pytorch.org/whl/cpu" in lines, path
        assert any(l.startswith("-r ") and l.endswith("requirements.txt") for l in lines), path
