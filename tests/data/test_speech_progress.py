"""The synthesis bar of the speech corpus counts whole seconds and ends at its total (issue 43,
item 9): it summed each utterance's float duration, so it ended at ``43.20000000000001/43`` with
tqdm's "clamping frac to range [0, 1]" warning."""

from __future__ import annotations

import re
import warnings

import pytest

from linformer_lab.data import speech as S


@pytest.mark.slow
def test_the_synthesis_bar_ends_at_its_total_in_whole_seconds(tmp_path, capsys):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        corpus = S.SyntheticSpeechCorpus(root=tmp_path, hours=0.012, seed=5, progress=True)
    assert corpus.generated
    bar = capsys.readouterr().err
    counts = re.findall(r"\| *([\d.]+)/([\d.]+) *\[", bar)
    assert counts, bar
    assert all("." not in done and "." not in total for done, total in counts), counts
    assert counts[-1][0] == counts[-1][1] == str(round(0.012 * 3600)), counts[-1]
    assert not [str(w.message) for w in caught if "clamping" in str(w.message)]
