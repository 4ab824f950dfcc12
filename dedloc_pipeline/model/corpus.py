"""The embedded Bengali corpus, built offline at set-up from registry packages that ship text.

- PyPI ``shobdo`` 0.2.2 (Apache-2.0): a Bengali dictionary whose ``shobdo/data/dictionary.db``
  (SQLite) holds ~45k example sentences and ~80k definitions. Only that file is read from the
  wheel; the package is never installed or imported.
- Debian ``libreoffice-l10n-bn`` (MPL-2.0): ~10k Bengali UI strings in gettext catalogs; the
  catalog a string comes from (Calc, Writer, ...) is a real label for classification.

No third-party text is committed to this repository; ``build`` fetches and extracts it, and
records where every file came from in PROVENANCE.json. The tokenize flow makes it a data set
(``shobdo.txt``, documents of 12 lines); an organizer's own corpus, or the hub's Bengali
Wikipedia and OSCAR that sahajBERT trained on, go through the same steps (dataset/).
"""

from __future__ import annotations

import gettext
import glob
import json
import os
import sqlite3
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

SHOBDO = {"package": "shobdo", "version": "0.2.2", "registry": "PyPI", "license": "Apache-2.0",
          "member": "shobdo/data/dictionary.db"}
LIBREOFFICE = {"package": "libreoffice-l10n-bn", "registry": "Debian", "license": "MPL-2.0",
               "path": "usr/lib/libreoffice/program/resource/bn/LC_MESSAGES"}


def fetch_shobdo(workdir: Path) -> Path:
    """Download the wheel (no install) and pull out the dictionary database."""
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    f"{SHOBDO['package']}=={SHOBDO['version']}", "-d", str(workdir)], check=True)
    wheel = next(workdir.glob("shobdo-*.whl"))
    db = workdir / "dictionary.db"
    with zipfile.ZipFile(wheel) as z, open(db, "wb") as out:
        out.write(z.read(SHOBDO["member"]))
    return db


def shobdo_sentences(db: Path) -> Iterator[str]:
    """Example sentences, then definitions, one per line, in dictionary order."""
    con = sqlite3.connect(db)
    try:
        for column in ("examples", "meanings"):
            for (raw,) in con.execute(f"SELECT {column} FROM words ORDER BY id"):
                for s in json.loads(raw or "[]"):
                    s = " ".join(str(s).split())
                    if s:
                        yield s
    finally:
        con.close()


def fetch_libreoffice(workdir: Path) -> tuple[Path, str]:
    """Download the Debian package (no install) and unpack it; apt lists are refreshed if needed.
    Returns the catalogs' folder and the package file's name."""
    cmd = ["apt-get", "download", LIBREOFFICE["package"]]
    if subprocess.run(cmd, cwd=workdir, capture_output=True).returncode != 0:
        if os.geteuid() != 0:
            raise RuntimeError("apt-get download libreoffice-l10n-bn failed; run `apt-get update` first")
        subprocess.run(["apt-get", "update", "-qq"], check=True)
        subprocess.run(cmd, cwd=workdir, check=True, capture_output=True)
    deb = next(workdir.glob("libreoffice-l10n-bn_*.deb"))
    root = workdir / "deb"
    subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
    return root / LIBREOFFICE["path"], deb.name


def libreoffice_strings(catalogs: Path) -> Iterator[tuple[str, str]]:
    """(catalog, Bengali string) for every translated message, menu accelerators removed."""
    for mo in sorted(glob.glob(str(catalogs / "*.mo"))):
        module = Path(mo).stem
        with open(mo, "rb") as f:
            catalog = gettext.GNUTranslations(f)._catalog  # noqa: SLF001 - the parsed message table
        for key, text in catalog.items():
            if not key or not isinstance(text, str):
                continue
            text = " ".join(text.replace("~", "").split())
            if any("\u0980" <= ch <= "\u09ff" for ch in text):
                yield module, text


def build(dest: str | os.PathLike) -> dict:
    """Write ``shobdo.txt``, ``libreoffice.tsv`` and ``PROVENANCE.json`` under ``dest`` (once)."""
    dest = Path(dest)
    prov_path = dest / "PROVENANCE.json"
    if prov_path.exists():
        return json.loads(prov_path.read_text())
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        lines = list(dict.fromkeys(shobdo_sentences(fetch_shobdo(work))))
        (dest / "shobdo.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
        catalogs, deb = fetch_libreoffice(work)
        pairs = list(dict.fromkeys(libreoffice_strings(catalogs)))
        with open(dest / "libreoffice.tsv", "w", encoding="utf-8") as f:
            for module, text in pairs:
                f.write(f"{module}\t{text}\n")
    prov = {"shobdo.txt": dict(SHOBDO, lines=len(lines)),
            "libreoffice.tsv": dict(LIBREOFFICE, file=deb, lines=len(pairs),
                                    labels=sorted({m for m, _ in pairs}))}
    prov_path.write_text(json.dumps(prov, indent=1, ensure_ascii=False))
    return prov


if __name__ == "__main__":
    where = sys.argv[1] if len(sys.argv) > 1 else ".dedloc/corpus"
    built = build(where)
    print(f"corpus in {where}: " + ", ".join(f"{name} ({p['lines']:,} lines)" for name, p in built.items())
          + " (sources and licences: PROVENANCE.json)")
