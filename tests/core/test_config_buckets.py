"""Default bucket sets: narrow page/row buckets for the jnp reference, one width for Pallas."""

import pytest

from jaxinfer.compile import enumerate_programs
from jaxinfer.config import ConfigError, EngineConfig, ModelConfig
from jaxinfer.engine_config import engine_config_for

MC = ModelConfig(family="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                 num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=4096)


def test_reference_backend_keeps_page_and_row_grids():
    ec = engine_config_for(MC, {"attention_backend": "reference", "max_model_len": 2048})
    assert ec.page_buckets == (16, 32, 64, 128)
    assert ec.prefill_seq_buckets == (1, 2, 4, 8)


def test_pallas_backend_compiles_one_table_width_and_row_count():
    ref = engine_config_for(MC, {"attention_backend": "reference", "max_model_len": 2048})
    ec = engine_config_for(MC, {"attention_backend": "pallas", "max_model_len": 2048})
    assert ec.page_buckets == (128,) and ec.prefill_seq_buckets == (8,)
    def split(c):  # model programs (one per bucket and mode) and the small helper programs
        progs = enumerate_programs(c)
        model = [p for p in progs if p.mode in ("sample", "logits")]
        return model, sorted(str(p) for p in progs if p.mode not in ("sample", "logits"))

    (m_pallas, h_pallas), (m_ref, h_ref) = split(ec), split(ref)
    # 6 prefill token buckets x (sample + logits) + 4 decode buckets, one width and row count
    assert len(m_pallas) == 16 < 100 < len(m_ref)
    # the helpers (sampler variants, page copy, history, ...) depend on the row buckets only
    assert h_pallas == h_ref


def test_explicit_buckets_win_over_the_pallas_default():
    ec = engine_config_for(MC, {"attention_backend": "pallas", "max_model_len": 2048,
                                "page_buckets": (32, 128), "prefill_seq_buckets": (2, 8)})
    assert ec.page_buckets == (32, 128) and ec.prefill_seq_buckets == (2, 8)


def test_prefill_seq_buckets_must_cover_max_prefill_seqs():
    with pytest.raises(ConfigError, match=r"the largest prefill_seq_bucket \(2\) must hold "
                                          r"max_prefill_seqs \(8\)"):
        EngineConfig(max_prefill_seqs=8, prefill_seq_buckets=(1, 2))


@pytest.mark.parametrize("kw, needle", [
    (dict(max_num_batched_tokens=512, prefill_buckets=(3, 7)),
     r"the largest prefill bucket \(7\) must hold max_num_batched_tokens \(512\)"),
    (dict(max_num_seqs=64, decode_buckets=(1, 16)),
     r"the largest decode bucket \(16\) must hold max_num_seqs \(64\) sequences"),
    # A wider block table than one max_model_len sequence's pages (--page-buckets 1000000
    # used to be taken: a [rows, 10**6] table every step).
    (dict(max_model_len=64, block_size=16, page_buckets=(4, 1000000)),
     r"page_buckets \(4, 1000000\): a block table never needs more than the 4 pages of one "
     r"max_model_len \(64\) sequence"),
])
def test_bucket_errors_give_both_values(kw, needle):
    with pytest.raises(ConfigError, match=needle):
        EngineConfig(**kw)
