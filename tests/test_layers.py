"""The layers import one way: device (proto.device: backend, memo, launcher, timing) <-
kernels <- runtime (proto.graph, shapes, models, vm, tape) <- experiments <- dev. Read from the source
(ast), so the check needs nothing imported and sees imports inside functions too."""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DEVICE = {"proto", "proto.device"}


def imports(path: pathlib.Path) -> set[str]:
    """Every module `path` imports (absolute names; `from a import b` gives a and a.b)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def _device(name: str) -> bool:
    """A module of the device layer, or a name imported from one."""
    return name == "proto" or name == "proto.device" or name.startswith("proto.device.")


def _ours(name: str) -> bool:
    return name.split(".")[0] in ("proto", "kernels", "experiments", "dev", "tests")


def sources(*folders):
    return [p for folder in folders for p in sorted((ROOT / folder).rglob("*.py"))]


@pytest.mark.parametrize("path", sources("kernels"), ids=lambda p: p.name)
def test_kernels_import_only_the_device_layer_and_each_other(path):
    wrong = sorted(n for n in imports(path) if _ours(n) and not n.startswith("kernels")
                   and not _device(n))
    assert not wrong, f"{path.relative_to(ROOT)} imports {wrong}: kernels sit below the runtime"


@pytest.mark.parametrize("path", sources("proto", "kernels", "experiments", "tests", "examples"),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_nothing_outside_dev_imports_dev(path):
    wrong = sorted(n for n in imports(path) if n.split(".")[0] == "dev")
    assert not wrong, f"{path.relative_to(ROOT)} imports {wrong}: dev/ is the lab, never a dependency"


def test_the_device_layer_imports_nothing_above_it():
    for path in sorted((ROOT / "proto" / "device").glob("*.py")):
        wrong = sorted(n for n in imports(path) if _ours(n) and not _device(n))
        assert not wrong, f"{path.relative_to(ROOT)} imports {wrong}"


def test_the_check_sees_a_wrong_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from proto.graph import capture\n    import dev.ab\n")
    assert {"proto.graph", "proto.graph.capture", "dev.ab"} <= imports(bad)
