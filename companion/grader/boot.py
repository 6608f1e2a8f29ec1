"""How a grading process starts: `python -I -c BOOT`, with its spec on stdin.

A grading process imports the package from the grader's private copy, each module checked
against the digest taken before any notebook ran, compiled from the bytes it checked (never
from bytecode): a notebook that ran with the grader's permissions and edited that copy stops
its own grading process ("changed in the grader's copy"), never changes the next notebook's
checks. This text is held by the batch process, which read it before any notebook ran.
"""

__all__ = ["BOOT"]

BOOT = r"""
import hashlib, importlib.abc, importlib.util, json, os, sys
spec = json.loads(sys.stdin.read())
root, digests = spec["private"], spec["digests"]

class Verified(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name != "companion" and not name.startswith("companion."):
            return None
        rel = name.replace(".", "/")
        for file, package in ((rel + "/__init__.py", True), (rel + ".py", False)):
            if file in digests:
                return importlib.util.spec_from_file_location(
                    name, os.path.join(root, file), loader=self,
                    submodule_search_locations=[os.path.join(root, rel)] if package else None)
        raise ModuleNotFoundError(f"no module named {name!r} in the grader's copy", name=name)

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        path = module.__spec__.origin
        with open(path, "rb") as f:
            data = f.read()
        if hashlib.sha256(data).hexdigest() != digests[os.path.relpath(path, root)]:
            raise ImportError(f"{os.path.relpath(path, root)} was changed in the grader's copy "
                              "since grading began")
        exec(compile(data, path, "exec"), module.__dict__)

sys.meta_path.insert(0, Verified())
sys.modules.setdefault("rfc3987_syntax", None)   # jsonschema's optional IRI grammar: 3 s to build
import companion.grader.job
sys.exit(companion.grader.job.main(spec))
"""
