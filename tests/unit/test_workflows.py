"""The repository's CI workflows parse and run the README's own commands (nothing can run
GitHub's runners here, so this is what can be checked: the files say the right things)."""
import importlib.util
from pathlib import Path

import pytest
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
    assert job["container"]["image"] == "python:3.11-bookworm"  # Debian: apt's chromium
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


def test_only_the_deploy_job_may_write_to_pages():
    flow = _workflow("book.yml")
    assert flow["permissions"] == {"contents": "read"}
    assert flow["jobs"]["deploy"]["permissions"] == {"pages": "write", "id-token": "write"}
    assert "permissions" not in flow["jobs"]["build"]


def test_book_runs_queue_per_branch_and_only_pull_requests_cancel():
    concurrency = _workflow("book.yml")["concurrency"]
    assert "${{ github.ref }}" in concurrency["group"]
    assert concurrency["cancel-in-progress"] == "${{ github.event_name == 'pull_request' }}"


def test_the_book_is_built_with_the_address_of_the_repository_it_runs_in():
    build = _workflow("book.yml")["jobs"]["build"]
    runs = _runs(build)
    step = next(s for s in build["steps"] if "set_repository.py" in s.get("run", ""))
    assert step["run"] == ('python scripts/set_repository.py '
                           '"${{ github.server_url }}/${{ github.repository }}"')
    assert step["if"] == "github.server_url == 'https://github.com'"
    assert runs.index(step["run"]) < runs.index("bash scripts/build_book.sh")


@pytest.mark.parametrize("name, job", [("ci.yml", "test"), ("book.yml", "build")])
def test_the_containers_give_chromium_and_the_workers_shared_memory(name, job):
    container = _workflow(name)["jobs"][job]["container"]
    assert container["image"] == "python:3.11-bookworm"
    size = container["options"].split("--shm-size=")[1].split()[0]
    assert size.endswith("g") and float(size[:-1]) >= 1, size  # Docker's default: 64m


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_binder_and_the_cpu_install_take_torchs_cpu_build_and_the_same_pins():
    for path, reads in (("binder/requirements.txt", "../requirements-reader.txt"),
                        ("requirements-cpu.txt", "requirements.txt")):
        lines = [l for l in (REPO / path).read_text().splitlines() if l and not l.startswith("#")]
        assert "--extra-index-url https://download.pytorch.org/whl/cpu" in lines, path
        assert f"-r {reads}" in lines, path
    assert "-r requirements-reader.txt" in (REPO / "requirements.txt").read_text().splitlines()


def test_binder_installs_what_a_reader_needs_and_nothing_for_the_tests_or_the_build():
    lock = _script("lock_requirements")
    binder = {r.name for r in lock.top_level_requirements(REPO / "binder" / "requirements.txt")}
    everything = {r.name for r in lock.top_level_requirements()}
    assert binder == {"torch", "numpy", "cloudpickle", "matplotlib", "ipywidgets", "ipykernel",
                      "jupyterlab"}
    assert binder < everything  # the full install still has the reader's packages
    assert not binder & {"jupyter-book", "nbval", "pytest", "pytest-timeout", "nbgrader",
                         "playwright", "axe-playwright-python"}
    reader = (REPO / "requirements-reader.txt").read_text().splitlines()
    assert "-e ." in reader and "-c constraints.txt" in reader  # the library, pinned


@pytest.mark.parametrize("given, stored", [
    ("https://github.com/course-org/dist-llm", "https://github.com/course-org/dist-llm"),
    ("https://github.com/a-b/c.d_e/ ", "https://github.com/a-b/c.d_e"),
    ("", ""),
])
def test_set_repository_takes_github_repository_addresses(given, stored):
    assert _script("set_repository").repository_url(given) == stored


@pytest.mark.parametrize("given, rule", [
    ("https://gitlab.com/owner/repo", "GitHub repositories only"),
    ("http://github.com/owner/repo", "GitHub repositories only"),
    ("https://www.github.com/owner/repo", "GitHub repositories only"),
    ("git@github.com:owner/repo.git", "GitHub repositories only"),
    ("https://github.com/owner/repo.git", "use https://github.com/owner/repo"),
    ("https://github.com/owner/repo/tree/main", "not OWNER/REPO"),
    ("https://github.com/owner", "not OWNER/REPO"),
    ("https://github.com/-owner/repo", "not a GitHub account name"),
    ("https://github.com/owner/re po", "not a GitHub repository name"),
    ("https://github.com/owner/..", "not a GitHub repository name"),
])
def test_set_repository_refuses_addresses_that_break_the_launch_links(given, rule, capsys):
    module = _script("set_repository")
    with pytest.raises(ValueError, match=rule):
        module.repository_url(given)
    before = (REPO / "_config.yml").read_text()
    assert module.main([given]) == 2  # refused before any file is written
    assert "set_repository.py: " in capsys.readouterr().err
    assert (REPO / "_config.yml").read_text() == before
