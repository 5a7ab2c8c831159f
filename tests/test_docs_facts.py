"""What the README and docs/ say about the configs is what the configs hold, and their links lead
somewhere.

Each checked paragraph is found by a phrase of its own and must state the values read from
``configs/*.yaml`` in the words the prose uses; a config that changes (or a paragraph that is
rewritten with other numbers) fails here instead of leaving the prose stale.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from linformer_lab.ops import kernels

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def config(name: str) -> dict:
    return yaml.safe_load((REPO / "configs" / name).read_text())


def the_same_in_all(pattern: str, pick, but: tuple[str, ...] = ()) -> object:
    """``pick(config)`` for every ``configs/<pattern>`` whose name starts with none of ``but``, which
    must all agree (the prose speaks of them as one)."""
    values = {path.name: pick(yaml.safe_load(path.read_text())) for path in sorted((REPO / "configs").glob(pattern))
              if not path.name.startswith(but)}
    assert values and len(set(map(repr, values.values()))) == 1, f"configs/{pattern} disagree: {values}"
    return next(iter(values.values()))


def paragraph(doc: str, phrase: str) -> str:
    """The paragraph of ``doc`` holding ``phrase``, on one line, thousands separators removed (10,000 -> 10000)."""
    found = [p for p in re.split(r"\n\s*\n", (REPO / doc).read_text()) if phrase in " ".join(p.split())]
    assert len(found) == 1, f"{doc}: expected one paragraph with {phrase!r}, found {len(found)}"
    return re.sub(r"(?<=\d)[, \u202f](?=\d{3}\b)", "", " ".join(found[0].split()))


def sci(x: float) -> str:
    """0.001 -> '1e-3', as the prose writes learning rates."""
    mantissa, exponent = f"{x:.0e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def assert_states(text: str, where: str, *facts: str) -> None:
    missing = [f for f in facts if f not in text]
    assert not missing, f"{where} does not state {missing} (the configs' values); it reads: {text[:600]}"


#: the copy configs at CPU scale (the conversion comparison's): the paper's lengths, a smaller model
CPU_SCALE_COPY = ("copy_cpu_", "copy_convert_")


def copy_settings() -> dict:
    """The settings of the paper-sized copy configs (``configs/copy_*.yaml`` but the CPU-scale ones)."""
    init = lambda c, part: c[part]["init_args"]  # noqa: E731
    same = lambda pick: the_same_in_all("copy_*.yaml", pick, but=CPU_SCALE_COPY)  # noqa: E731
    return dict(
        min=same(lambda c: init(c, "data")["min_length"]),
        max=same(lambda c: init(c, "data")["max_length"]),
        dropout=same(lambda c: init(c, "model")["dropout"]),
        d_model=same(lambda c: init(c, "model")["d_model"]),
        layers=same(lambda c: init(c, "model")["n_layers"]),
        heads=same(lambda c: init(c, "model")["n_heads"]),
        batch=same(lambda c: init(c, "data")["batch_size"]),
        lr=same(lambda c: init(c, "model")["lr"]),
        decay=same(lambda c: (init(c, "model")["lr_decay_steps"], init(c, "model")["lr_decay_factor"])),
        steps=same(lambda c: c["trainer"]["max_steps"]),
        val_every=same(lambda c: c["trainer"]["val_check_interval"]),
    )


def test_cli_md_states_the_copy_configs():
    s = copy_settings()
    steps, factor = s["decay"]
    text = paragraph("docs/cli.md", "The configs hold the paper's settings")
    assert_states(text, "docs/cli.md (Train)", f"{s['layers']} layers × {s['heads']} heads", f"d_model {s['d_model']}",
                  f"dropout {s['dropout']}", f"{s['min']}-{s['max']} symbols", f"at most {2 * s['max'] + 1} positions",
                  f"batch {s['batch']}", f"lr {sci(s['lr'])} → {sci(s['lr'] * factor)} after {steps} updates",
                  f"{s['steps']} updates", f"validation every {s['val_every']}")


def test_every_symbol_range_in_the_docs_is_the_copy_configs():
    """'A-B symbols' anywhere in the README or docs/ is the range the copy configs draw (earlier runs
    at other lengths are written 'A to B symbols' and say so)."""
    s = copy_settings()
    ranges = [(doc.name, m) for doc in DOCS for m in re.finditer(r"(\d+)\s?[–-]\s?(\d+) (?:random )?symbols", doc.read_text())]
    assert ranges, "no 'A-B symbols' in the docs: the pattern no longer matches their wording"
    found = [(name, m.group(0)) for name, m in ranges if (int(m.group(1)), int(m.group(2))) != (s["min"], s["max"])]
    assert not found, f"the copy configs draw {s['min']}-{s['max']} symbols; the docs say {found}"
    cpu_scale = {(the_same_in_all(f"{prefix}*.yaml", lambda c: c["data"]["init_args"][key]))
                 for prefix in CPU_SCALE_COPY for key in ("min_length", "max_length")}
    assert cpu_scale == {s["min"], s["max"]}, f"the CPU-scale copy configs draw other lengths: {cpu_scale}"


def test_reproduction_states_the_authors_copy_settings_as_the_configs_hold_them():
    s = copy_settings()
    text = paragraph("docs/REPRODUCTION.md", "\"maximum length 128\" is the whole example")
    assert_states(text, "REPRODUCTION.md (Fig. 2, the paper's lengths)", f"{s['min']}–{s['max']} random symbols",
                  f"dropout {s['dropout']}", "`configs/copy_*.yaml` use these lengths and dropout",
                  "`copy_cpu_*.yaml` and `copy_convert_*.yaml` the same lengths")


def mnist_cpu_settings() -> dict:
    model = lambda key: the_same_in_all("mnist_cpu_*.yaml", lambda c: c["model"]["init_args"][key])  # noqa: E731
    return dict(layers=model("n_layers"), heads=model("n_heads"), d_model=model("d_model"), d_ff=model("d_ff"),
                lr=model("lr"), warmup=model("warmup_steps"), schedule=model("lr_schedule"),
                batch=the_same_in_all("mnist_cpu_*.yaml", lambda c: c["data"]["init_args"]["batch_size"]),
                limit_val=the_same_in_all("mnist_cpu_*.yaml", lambda c: c["data"]["init_args"]["limit_val"]),
                steps=the_same_in_all("mnist_cpu_*.yaml", lambda c: c["trainer"]["max_steps"]),
                val_every=the_same_in_all("mnist_cpu_*.yaml", lambda c: c["trainer"]["val_check_interval"]),
                clip=the_same_in_all("mnist_cpu_*.yaml", lambda c: c["trainer"]["gradient_clip_val"]))


def test_readme_states_the_mnist_cpu_recipe():
    s = mnist_cpu_settings()
    text = paragraph("README.md", "CPU-scale recipe of Table 1")
    assert_states(text, "README.md (Training on a CPU)", f"{s['layers']} layers", f"d_model {s['d_model']}",
                  f"{s['steps']} updates of {s['batch']} images")


def test_reproduction_states_the_mnist_cpu_recipe():
    s = mnist_cpu_settings()
    text = paragraph("docs/REPRODUCTION.md", "the same for every attention:")
    assert_states(text, "REPRODUCTION.md (Table 1, Scale)", f"{s['layers']} layers × {s['heads']} heads",
                  f"d_model {s['d_model']}", f"feed-forward {s['d_ff']}", f"batch {s['batch']}", f"{s['steps']} updates",
                  f"{sci(s['lr'])} with {s['warmup']} warm-up updates and a {s['schedule']} schedule",
                  f"clipped at {s['clip']}", f"validation on {s['limit_val']} images every {s['val_every']} updates")


def test_reproduction_states_the_speech_cpu_recipe():
    model = lambda key: the_same_in_all("speech_cpu_[ls]*.yaml", lambda c: c["model"]["init_args"][key])  # noqa: E731
    data = lambda key: the_same_in_all("speech_cpu_*.yaml", lambda c: c["data"]["init_args"][key])  # noqa: E731
    epochs = the_same_in_all("speech_cpu_*.yaml", lambda c: c["trainer"]["max_epochs"])
    text = paragraph("docs/REPRODUCTION.md", "A synthetic eSpeak NG corpus of")
    assert_states(text, "REPRODUCTION.md (Table 3, Scale)", f"corpus of {data('hours'):g} h",
                  f"transformers {model('n_layers')} layers × {model('n_heads')} heads, d_model {model('d_model')}",
                  f"stride-{model('subsample')} convolution", f"Adam {sci(model('lr'))}",
                  f"{model('warmup_steps')}-update warm-up", f"{epochs} epochs", f"batch {data('batch_size')}")


def the_prose_check_fails_on_a_wrong_value():
    """The helpers themselves: a paragraph that states another value is reported with what it lacks."""
    with pytest.raises(AssertionError, match=r"does not state \['d_model 999'\]"):
        assert_states("4 layers, d_model 128", "here", "4 layers", "d_model 999")


def test_the_checker_reports_what_a_paragraph_lacks():
    the_prose_check_fails_on_a_wrong_value()
    assert paragraph("docs/cli.md", "The configs hold the paper's settings").count("\n") == 0
    assert sci(0.001) == "1e-3" and sci(0.0001) == "1e-4"


# ---------------------------------------------------------------- links
def github_slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("doc", DOCS, ids=[d.name for d in DOCS])
def test_every_link_of_the_docs_leads_to_a_file_and_heading(doc):
    """Relative links of the README and docs/ name files that exist and, with ``#anchor``, a heading there."""
    text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        name, _, anchor = target.partition("#")
        dest = (doc.parent / name).resolve() if name else doc
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md":
            slugs = {github_slug(h) for h in re.findall(r"^#+ (.+)$", dest.read_text(), flags=re.M)}
            if anchor not in slugs:
                broken.append(f"{target} (no such heading)")
    assert not broken, f"{doc.name}: {broken}"


def test_github_slug_drops_punctuation_as_github_does():
    assert github_slug("The causal numerator on CPU (§3.3, eq. 13–15)") == "the-causal-numerator-on-cpu-33-eq-1315"
    assert github_slug("Table 1: MNIST, bits/dim and images/s (§4.2.1)") == "table-1-mnist-bitsdim-and-imagess-421"


# ---------------------------------------------------------------- kernels
#: Where the docs name kernels: as ``op=name``, the value LINFORMER_LAB_KERNELS takes to force one.
KERNEL_DOCS = [*DOCS, REPO / "benchmarks" / "README.md", *sorted((REPO / "examples").glob("*/README.md"))]


def kernel_candidates() -> dict[str, list[str]]:
    """op -> its candidates' names, first to last, as ``ops/kernels.py`` lists them."""
    return {op: [candidate.name for candidate in candidates] for op, candidates in kernels.CANDIDATES.items()}


def every_kernel() -> set[tuple[str, str]]:
    return {(op, name) for op, names in kernel_candidates().items() for name in names}


def named_kernels(text: str) -> set[tuple[str, str]]:
    """Every ``op=name`` in ``text`` whose op is one of ``ops/kernels.py`` (``causal=True`` is Python, not a kernel)."""
    ops = "|".join(sorted(kernels.CANDIDATES, key=len, reverse=True))
    return set(re.findall(rf"(?<![\w.-])({ops})=([a-z_0-9]+)", text))


def section(doc: str, heading: str) -> str:
    """The text under ``heading`` (a whole heading line) down to the next heading of its level or above."""
    text = (REPO / doc).read_text()
    level = heading.split(" ")[0]
    start = text.index(f"\n{heading}\n")
    end = re.search(rf"\n#{{1,{len(level)}}} ", text[start + 1:])
    return text[start: start + 1 + end.start()] if end else text[start:]


def test_every_kernel_the_docs_name_is_a_candidate_of_its_op():
    """``op=name`` anywhere in the README, docs/, the benchmarks' and examples' READMEs and kernels.py's
    own docstring names a candidate ``ops/kernels.py`` has (a renamed or deleted kernel fails here)."""
    sources = {str(path.relative_to(REPO)): path.read_text() for path in KERNEL_DOCS}
    sources["linformer_lab/ops/kernels.py (docstring)"] = kernels.__doc__
    stale = {where: sorted(named_kernels(text) - every_kernel()) for where, text in sources.items()}
    assert not any(stale.values()), f"kernels the docs name that ops/kernels.py does not have: {stale}"


def test_the_readme_backend_table_names_every_kernel():
    rows = [line for line in (REPO / "README.md").read_text().splitlines() if re.match(r"\| `(linear|lsh)` \|", line)]
    named = named_kernels("\n".join(rows))
    assert named == every_kernel(), (f"README's backend table (rows linear, lsh) lacks {sorted(every_kernel() - named)} "
                                     f"and names {sorted(named - every_kernel())} (ops/kernels.py's candidates)")


def test_architecture_names_every_kernel():
    named = named_kernels(section("docs/ARCHITECTURE.md", "## Where speed code goes"))
    assert named == every_kernel(), (f"docs/ARCHITECTURE.md ('Where speed code goes') lacks {sorted(every_kernel() - named)} "
                                     f"and names {sorted(named - every_kernel())} (ops/kernels.py's candidates)")


def kernel_table(text: str) -> dict[str, list[str]]:
    """A markdown table ``| `op` (what it is) | `name` (when), `name`, ... |`` as op -> names, in order:
    the backticked words outside parentheses."""
    table = {}
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) != 2 or not cells[0].startswith("`"):
            continue
        while re.search(r"\([^()]*\)", cells[1]):
            cells[1] = re.sub(r"\([^()]*\)", "", cells[1])
        table[re.match(r"`(\w+)`", cells[0]).group(1)] = re.findall(r"`(\w+)`", cells[1])
    return table


def test_cli_md_kernel_table_lists_every_op_and_its_candidates_in_order():
    table = kernel_table(section("docs/cli.md", "## Kernels and switches"))
    assert table == kernel_candidates(), f"docs/cli.md's kernel table: {table}; ops/kernels.py: {kernel_candidates()}"


def test_kernels_docstring_table_lists_every_op_and_its_candidates_in_order():
    body = kernels.__doc__.split("\n=====")[2]  # the table's rows: between its second and third rule
    rows = [re.split(r"\s{2,}", line.strip()) for line in body.splitlines() if line.startswith("``")]
    table = {row[0].strip("`"): [name.strip() for name in row[1].split(",")] for row in rows}
    assert table == kernel_candidates(), f"ops/kernels.py's docstring table: {table}; CANDIDATES: {kernel_candidates()}"


def test_the_kernel_checks_see_a_stale_name():
    assert named_kernels("`causal=chunk`, LINFORMER_LAB_KERNELS=lsh_window=cpp; causal=True") == {
        ("causal", "chunk"), ("lsh_window", "cpp")}
    assert kernel_table("| `causal` (the numerator) | `cuda` (CUDA, `x` inside), `reference` |\n|---|---|") == {
        "causal": ["cuda", "reference"]}


def test_every_environment_variable_the_docs_name_is_read_somewhere():
    """A ``LINFORMER_LAB_*`` variable in the README, docs/ or the benchmarks' and examples' READMEs is read
    by the library, the tests, the benchmarks or CI (a removed variable fails here)."""
    code = "\n".join(path.read_text() for root in ("linformer_lab", "tests", "benchmarks", ".ci", "scripts")
                     for path in (REPO / root).rglob("*") if path.suffix in (".py", ".cpp", ".h", ".cu", ".sh", ".yml"))
    named = {name for path in KERNEL_DOCS for name in re.findall(r"LINFORMER_LAB_[A-Z0-9_]+", path.read_text())}
    unread = sorted(name for name in named if not re.search(rf"\b{name}\b", code))
    assert not unread, f"environment variables the docs name that no code reads: {unread}"
