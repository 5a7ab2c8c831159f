"""Plugin discovery through real entry points: built-ins, a third-party package, errors."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import linformer_lab as ll
from linformer_lab.registry import PluginError

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "third_party_feature_map"


def test_builtins_are_registered_through_our_own_entry_points():
    assert {"softmax", "linear", "linear_cuda", "lsh"} <= set(ll.list_attention())
    assert {"elu", "poly2", "random_fourier", "favor"} <= set(ll.list_feature_maps())
    dists = ll.registry.ATTENTION.distributions()
    assert dists["linear"] == [f"linformer_lab=={ll.__version__}"]


def test_unknown_name_lists_valid_choices_and_closest_match():
    with pytest.raises(PluginError) as err:
        ll.build_feature_map("favour", query_dim=4)
    message = str(err.value)
    assert "Unknown feature map 'favour'" in message and "Did you mean 'favor'?" in message
    for name in ll.list_feature_maps():
        assert name in message
    with pytest.raises(PluginError, match="Valid choices: .*softmax"):
        ll.build_attention("sofmax", query_dim=4)


def _write_distribution(site: Path, dist: str, module: str, source: str, entry_points: str) -> None:
    """A minimal installed distribution: the module plus a .dist-info like pip writes."""
    (site / f"{module}.py").write_text(textwrap.dedent(source))
    info = site / f"{dist}-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(textwrap.dedent(entry_points))
    (info / "RECORD").write_text("")


def _run(site: Path, code: str) -> subprocess.CompletedProcess:
    """Run code in a fresh interpreter with `site` on the path: discovery through the standard
    importlib.metadata machinery, no patching of our registry."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(REPO)]))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True, timeout=120)


def _install_example(site: Path) -> None:
    """Install examples/third_party_feature_map the way an installer would: its package
    directory plus a .dist-info carrying the entry points from its pyproject."""
    import shutil

    import tomllib

    project = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())["project"]
    shutil.copytree(EXAMPLE / "linformer_lab_softplus", site / "linformer_lab_softplus")
    info = site / f"{project['name'].replace('-', '_')}-{project['version']}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
    lines = []
    for group, entries in project["entry-points"].items():
        lines.append(f"[{group}]")
        lines += [f"{name} = {target}" for name, target in entries.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    (info / "RECORD").write_text("")


#: What each test below runs in the fresh interpreter (``ll``: linformer_lab), all in one: every
#: plugin of them is installed in one site (:func:`plugins_run`); each prints what it checks.
SCENARIOS = {
    "third_party": """
        import torch
        assert "softplus" in ll.list_feature_maps(), ll.list_feature_maps()
        attn = ll.build_attention("linear", causal=True, query_dim=4, feature_map="softplus")
        q, k, v = (torch.randn(1, 2, 9, 4, dtype=torch.float64) for _ in range(3))
        out = attn.double()(q, k, v)
        phi = torch.nn.functional.softplus
        w = (phi(q) @ phi(k).transpose(-1, -2)).tril()
        torch.testing.assert_close(out, (w @ v) / (w.sum(-1, keepdim=True) + attn.eps))
        print(ll.registry.FEATURE_MAPS.distributions()["softplus"])
    """,
    "clash": """
        try:
            ll.build_feature_map("clash", query_dim=4)
        except ll.PluginError as e:
            print(e)
        ll.build_feature_map("elu", query_dim=4)  # the rest keeps working
    """,
    "broken": """
        assert "broken" in ll.list_attention()
        try:
            ll.build_attention("broken", query_dim=4)
        except ll.PluginError as e:
            print(e)
        print(type(ll.build_attention("linear", query_dim=4)).__name__)
    """,
    "odd": """
        try:
            ll.build_feature_map("odd", query_dim=4)
        except ll.PluginError as e:
            print(e)
    """,
}

_SCENARIO_RUNNER = """
import sys, textwrap, traceback
import linformer_lab as ll
for name, code in SCENARIOS.items():
    print(f"== {name}", flush=True)
    try:
        exec(textwrap.dedent(code), {"ll": ll})
    except Exception:
        traceback.print_exc(file=sys.stdout)
"""


@pytest.fixture(scope="module")
def plugins_run(tmp_path_factory) -> dict[str, str]:
    """The example plugin, two distributions registering one name, a plugin that fails to import
    and one registering a function, installed in one site; :data:`SCENARIOS` run in one fresh
    interpreter there (its start costs more than all of them): {scenario: what it printed}."""
    site = tmp_path_factory.mktemp("site")
    _install_example(site)
    for dist in ("plugin_a", "plugin_b"):
        _write_distribution(
            site, dist, f"{dist}_mod",
            "from linformer_lab.feature_maps.elu import EluFeatureMap as Map\n",
            f"[linformer_lab.feature_maps]\nclash = {dist}_mod:Map\n",
        )
    _write_distribution(
        site, "broken_plugin", "broken_mod",
        "raise ImportError('needs a package that is not installed')\n",
        "[linformer_lab.attention]\nbroken = broken_mod:Backend\n",
    )
    _write_distribution(
        site, "odd_plugin", "odd_mod", "def not_a_class():\n    pass\n",
        "[linformer_lab.feature_maps]\nodd = odd_mod:not_a_class\n",
    )
    result = _run(site, f"SCENARIOS = {SCENARIOS!r}\n" + _SCENARIO_RUNNER)
    assert result.returncode == 0, result.stderr
    sections = result.stdout.split("== ")[1:]
    printed = {section.split("\n", 1)[0]: section.split("\n", 1)[1] for section in sections}
    assert list(printed) == list(SCENARIOS), result.stdout
    return printed


@pytest.mark.slow
def test_third_party_feature_map_works_by_name(plugins_run):
    out = plugins_run["third_party"]
    assert "Traceback" not in out, out
    assert "linformer-lab-softplus==0.1.0" in out


@pytest.mark.slow
def test_two_distributions_registering_one_name_is_an_error_naming_both(plugins_run):
    out = plugins_run["clash"]
    assert "Traceback" not in out, out
    assert "more than one distribution" in out
    assert "plugin_a==0.1.0" in out and "plugin_b==0.1.0" in out


@pytest.mark.slow
def test_plugin_that_fails_to_import_is_named_and_others_still_work(plugins_run):
    out = plugins_run["broken"]
    assert "Traceback" not in out, out
    assert "'broken' from distribution broken_plugin==0.1.0 failed to import" in out
    assert "needs a package that is not installed" in out
    assert "LinearAttention" in out


@pytest.mark.slow
def test_registered_object_of_wrong_type_is_rejected(plugins_run):
    assert "not a linformer_lab.feature_maps.FeatureMap subclass" in plugins_run["odd"], plugins_run["odd"]


def test_source_checkout_without_metadata_reads_builtins_from_pyproject(monkeypatch):
    """`PYTHONPATH=.` on a node without network (README): the project is not installed, so no
    entry points of ours exist; the built-ins then come from the checkout's pyproject.toml."""
    from importlib import metadata

    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11: the reference reading of pyproject.toml
    # linear's module imported before the stand-ins below: its first import imports Triton, which
    # would take the stand-in entry_points (it calls it without a group) for good
    import linformer_lab.attention.linear  # noqa: F401
    from linformer_lab import registry

    def not_installed(name):
        raise metadata.PackageNotFoundError(name)

    real_entry_points = metadata.entry_points
    monkeypatch.setattr(metadata, "distribution", not_installed)
    monkeypatch.setattr(metadata, "entry_points", lambda group: [ep for ep in real_entry_points(group=group)
                                                                  if ep.dist is None or ep.dist.name != "linformer_lab"])
    tables = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"]
    valid = {}
    for group, kind in (("linformer_lab.attention", "attention backend"), ("linformer_lab.feature_maps", "feature map")):
        # plugins installed beside the checkout (the README's examples) keep their own entry points
        plugins = {ep.name for ep in real_entry_points(group=group) if ep.dist is not None and ep.dist.name != "linformer_lab"}
        fresh = registry.Registry(group, kind=kind)
        valid[group] = sorted(set(tables[group]) | plugins)
        assert fresh.names() == valid[group]
        assert set(fresh.distributions()["linear" if kind.startswith("attention") else "elu"]) == {registry.SOURCE_CHECKOUT}
    attention = registry.Registry("linformer_lab.attention", kind="attention backend")
    assert attention.get("linear") is ll.attention.linear.LinearAttention
    assert {"linear", "linear_cuda", "lsh", "softmax"} <= set(valid["linformer_lab.attention"])
    with pytest.raises(PluginError, match=f"Valid choices: {', '.join(valid['linformer_lab.attention'])}"):
        attention.get("liner")


def test_installed_project_is_not_also_read_from_pyproject():
    """Installed (this test environment), each built-in comes from the metadata once."""
    from linformer_lab import registry

    assert registry._source_checkout_entry_points("linformer_lab.attention") == []
    assert all(len(d) == 1 for d in registry.ATTENTION.distributions().values())
