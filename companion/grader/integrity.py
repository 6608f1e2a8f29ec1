"""The grader's own files, snapshotted before any notebook runs and checked after each one.

A learner's code that runs with the grader's permissions (a grader not started as root) could edit
the installed companion package or drop a .pth file into site-packages. `Snapshot` keeps the bytes
of the package and of what every interpreter runs at start (site-packages' .pth files,
sitecustomize); `changes()` lists what differs; `restore()` writes the package back and deletes
files that appeared in it; `clean_caches()` deletes bytecode written since. A changed
site-packages is not put back: the grader stops there and says so. `private_copy` gives the
grading processes a copy of the package and of the source notebooks, taken at the start, in a
folder only the grader can read: the expectations and the checks come from there, whatever
happens to the originals (which are never written).
"""
from __future__ import annotations

import hashlib
import os
import pathlib
import shutil
import site
import tempfile

from companion.grader.stopping import remove_stale, tag

__all__ = ["Snapshot"]


def _files(root: pathlib.Path, pattern: str = "**/*") -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.glob(pattern))
            if p.is_file() and "__pycache__" not in p.parts}


def _identity(path: pathlib.Path) -> tuple:
    st = path.lstat()
    return st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino


def _site_dirs() -> list[pathlib.Path]:
    dirs = list(site.getsitepackages()) + [site.getusersitepackages()]
    return [pathlib.Path(d) for d in dict.fromkeys(dirs) if os.path.isdir(d)]


class Snapshot:
    """The package at `package` (a folder), the notebooks in `sources`, and site-packages."""

    def __init__(self, package: pathlib.Path, sources: list[pathlib.Path]):
        self.package, self.sources = package, sources
        self.files = _files(package)
        self.caches = self._caches()
        self.notebooks = {p: p.read_bytes() for p in sources}
        self.environment = self._environment()

    def _caches(self) -> dict[str, tuple]:
        return {str(p): _identity(p) for p in self.package.glob("**/__pycache__/*")}

    def _environment(self) -> dict[str, str]:
        """What runs at every interpreter's start: .pth files and site/usercustomize modules."""
        out = {}
        for d in _site_dirs():
            for entry in d.iterdir():
                if entry.suffix == ".pth" or entry.stem in ("sitecustomize", "usercustomize"):
                    out[str(entry)] = hashlib.sha256(entry.read_bytes()).hexdigest() \
                        if entry.is_file() else "not a file"
        return out

    def open_to_all(self) -> list[str]:
        """Folders of the package or site-packages (top level) that any user may write."""
        folders = [self.package, *(p for p in self.package.rglob("*") if p.is_dir()),
                   *_site_dirs()]
        return [str(p) for p in folders if p.stat().st_mode & 0o002]

    def changes(self) -> list[str]:
        """What differs from the snapshot, as paths (package files relative to the package)."""
        now = _files(self.package)
        changed = [f"companion/{k}" for k in sorted(set(now) | set(self.files))
                   if now.get(k) != self.files.get(k)]
        return changed + self.environment_changes()

    def environment_changes(self) -> list[str]:
        now = self._environment()
        return [k for k in sorted(set(now) | set(self.environment))
                if now.get(k) != self.environment.get(k)]

    def restore(self) -> None:
        """Put the package back as it was; remove files that appeared in it."""
        for rel in set(_files(self.package)) - set(self.files):
            (self.package / rel).unlink(missing_ok=True)
        for rel, data in self.files.items():
            path = self.package / rel
            if not path.is_file() or path.read_bytes() != data:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(data)
        self.clean_caches()

    def clean_caches(self) -> None:
        """Delete bytecode that appeared or changed in the package since the snapshot: a planted
        .pyc would otherwise be loaded in place of its source."""
        for cache, identity in self._caches().items():
            if self.caches.get(cache) != identity:
                pathlib.Path(cache).unlink(missing_ok=True)

    def _private_files(self) -> dict[str, bytes]:
        """What `private_copy` holds: {path there: bytes}."""
        out = {f"companion/{rel}": data for rel, data in self.files.items()}
        out.update({f"sources/{path.name}": data for path, data in self.notebooks.items()})
        return out

    def private_copy(self) -> pathlib.Path:
        """A folder (mode 700) holding companion/ and sources/ as snapshotted, named after this
        process; copies that graders killed by SIGKILL left are deleted first (`stopping`)."""
        remove_stale("companion-grader")
        root = pathlib.Path(tempfile.mkdtemp(prefix=tag("companion-grader")))
        self.restore_private(root)
        return root

    def digests(self) -> dict[str, str]:
        """SHA-256 of each file of `private_copy`, by its path there."""
        return {rel: hashlib.sha256(data).hexdigest()
                for rel, data in self._private_files().items()}

    def private_changes(self, root: pathlib.Path) -> list[str]:
        """What differs in a `private_copy` at root from the snapshot (paths there)."""
        want = self._private_files()
        have = {str(p.relative_to(root)): p for p in root.rglob("*")
                if p.is_file() and "__pycache__" not in p.parts}
        changed = [rel for rel, data in want.items()
                   if rel not in have or have[rel].read_bytes() != data]
        return changed + sorted(set(have) - set(want))

    def restore_private(self, root: pathlib.Path) -> None:
        """Write a `private_copy` at root as snapshotted (files that appeared in it are deleted)."""
        want = self._private_files()
        for path in [p for p in root.rglob("*") if p.is_file() or p.is_symlink()]:
            if str(path.relative_to(root)) not in want:
                path.unlink()
        for rel, data in want.items():
            path = root / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            if not path.is_file() or path.is_symlink() or path.read_bytes() != data:
                path.unlink(missing_ok=True)
                path.write_bytes(data)

    @staticmethod
    def remove(root: pathlib.Path) -> None:
        shutil.rmtree(root, ignore_errors=True)

