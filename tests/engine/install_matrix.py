"""Install this project and mstar-ai in both orders, uninstall each: nothing of the other moves.

``python tests/engine/install_matrix.py`` runs in a virtual environment that has mstar-ai
0.2.1 and its dependencies (the engine job's). It builds this project's wheel, then:

1. engine first: install the store, uninstall it;
2. store first: uninstall the engine, install the store, install the engine, uninstall the
   engine, install it again, uninstall the store;

and after every step checks, file by file, that every file of the other distribution is
byte-identical to before (and to the hashes in its RECORD), that the store installs no file
outside its own top-level package ``store``, and that ``import store`` and (with the engine)
``import mstar.conductor.conductor`` work in one process, from a neutral folder and from the
checkout. It leaves the environment as it found it: the engine installed and this checkout
installed in editable mode. Exit status 1 on the first broken check.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[2]
ENGINE, STORE = "mstar-ai", "mstar-conductor-store"
IMPORTS = "import store, store.types as t, store.codec;print(t.SOURCE, t.PartitionState.__module__)"
WITH_ENGINE = "import mstar.conductor.conductor;" + IMPORTS
BOOKKEEPING = frozenset(["RECORD", "INSTALLER", "REQUESTED", "direct_url.json"])


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *args],
                   check=True)  # fmt: skip


def snapshot(dist: str) -> dict[str, str]:
    """Every installed file of ``dist`` -> its sha256 (as RECORD writes it), read fresh.

    Compiled files and pip's own bookkeeping are left out: pip writes them at each install
    (``direct_url.json`` says whether it came from a file or an index).
    """
    code = (
        "import base64, hashlib, importlib.metadata as m, json, sys\n"
        f"d = m.distribution({dist!r})\n"
        f"BOOKKEEPING = {sorted(BOOKKEEPING)!r}\n"
        "out = {}\n"
        "for f in d.files or []:\n"
        "    p = f.locate()\n"
        "    if p.suffix == '.pyc' or p.name in BOOKKEEPING or not p.is_file():\n"
        "        continue\n"
        "    digest = hashlib.sha256(p.read_bytes()).digest()\n"
        "    out[str(f)] = base64.urlsafe_b64encode(digest).rstrip(b'=').decode()\n"
        "json.dump(out, sys.stdout)\n"
    )
    return _fresh_json(code)


def recorded(dist: str) -> dict[str, str]:
    """The sha256 hashes ``dist``'s RECORD lists (what pip installed)."""
    code = (
        "import importlib.metadata as m, json, sys\n"
        f"d = m.distribution({dist!r})\n"
        "json.dump({str(f): f.hash.value for f in d.files or [] if f.hash}, sys.stdout)\n"
    )
    return _fresh_json(code)


def _fresh_json(code: str) -> dict[str, str]:
    """What ``code`` prints as JSON, run in a new interpreter: it sees what pip just did."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, cwd=tempfile.gettempdir())  # fmt: skip
    return dict(json.loads(done.stdout))


class Matrix:
    def __init__(self) -> None:
        self.failures: list[str] = []

    def check(self, ok: bool, what: str) -> None:
        print(f"  {'ok  ' if ok else 'FAIL'} {what}")
        if not ok:
            self.failures.append(what)

    def unchanged(self, dist: str, before: dict[str, str], step: str) -> None:
        after = snapshot(dist)
        changed = sorted(f for f in before if after.get(f) != before[f])
        self.check(
            not changed,
            f"{step}: {len(before)} files of {dist}, {len(before) - len(changed)} byte-identical"
            + (f"; changed or gone: {changed[:10]}" if changed else ""),
        )
        held = recorded(dist)
        wrong = sorted(f for f, h in held.items() if after.get(f) not in (h, None))
        self.check(not wrong, f"{step}: {dist} files match its RECORD ({len(held)} hashed)")

    def imports(self, code: str, source: str, step: str) -> None:
        for where in (Path(tempfile.gettempdir()), CHECKOUT):
            done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                  cwd=where, check=False)  # fmt: skip
            said = done.stdout.strip().splitlines()[-1:] or [done.stderr.strip()[-300:]]
            self.check(
                done.returncode == 0 and said[0].startswith(source),
                f"{step}: imports from {where}: {said[0]}",
            )

    def store_stays_inside(self, step: str) -> None:
        outside = sorted(
            f for f in snapshot(STORE)
            if not (f.startswith("store/") or f.split("/")[0].endswith(".dist-info")
                    or f.startswith("../../../bin/"))
        )  # fmt: skip
        self.check(not outside, f"{step}: the store's files all lie under store/ ({outside[:5]})")


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="install-matrix-"))
    print(f"wheels in {work}")
    pip("wheel", "--no-deps", "-w", str(work), str(CHECKOUT))
    pip("download", "--no-deps", "-d", str(work), f"{ENGINE}==0.2.1")
    store_wheel = next(work.glob("mstar_conductor_store-*.whl"))
    engine_wheel = next(work.glob("mstar_ai-*.whl"))
    m = Matrix()

    print("1. engine first")
    pip("uninstall", "-y", STORE)
    engine_files = snapshot(ENGINE)
    pip("install", "--no-deps", str(store_wheel))
    m.unchanged(ENGINE, engine_files, "store installed after the engine")
    m.store_stays_inside("store installed after the engine")
    m.imports(WITH_ENGINE, "engine mstar.conductor.request_info", "both installed")
    pip("uninstall", "-y", STORE)
    m.unchanged(ENGINE, engine_files, "store uninstalled")
    m.imports("import mstar.conductor.conductor; print('engine')", "engine", "engine alone")

    print("2. store first")
    pip("uninstall", "-y", ENGINE)
    pip("install", "--no-deps", str(store_wheel))
    store_files = snapshot(STORE)
    m.imports(IMPORTS, "bundled store._mstar.conductor.request_info", "store alone")
    pip("install", "--no-deps", str(engine_wheel))
    m.unchanged(STORE, store_files, "engine installed after the store")
    m.unchanged(ENGINE, engine_files, "engine installed after the store (its own files)")
    m.imports(WITH_ENGINE, "engine mstar.conductor.request_info", "both installed")
    pip("uninstall", "-y", ENGINE)
    m.unchanged(STORE, store_files, "engine uninstalled")
    m.imports(IMPORTS, "bundled store._mstar.conductor.request_info", "store alone again")
    pip("install", "--no-deps", str(engine_wheel))
    pip("uninstall", "-y", STORE)
    m.unchanged(ENGINE, engine_files, "store uninstalled last")

    print("restoring: the checkout in editable mode beside the engine")
    pip("install", "--no-deps", "-e", str(CHECKOUT))
    m.imports(WITH_ENGINE, "engine mstar.conductor.request_info", "editable beside the engine")
    shutil.rmtree(work)
    print(f"{len(m.failures)} failed" if m.failures else "install matrix: all checks passed")
    return 1 if m.failures else 0


if __name__ == "__main__":
    sys.exit(main())
