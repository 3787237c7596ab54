"""The model family's tokenizers and shapes (building a member is the benchmark's job)."""

from __future__ import annotations

from transformers import AutoTokenizer

from pipeline_rl.demo import BUILT, tiny_model
from pipeline_rl.demo.family import ALPHABET, FAMILY, char_tokenizer


def test_char_tokenizer_is_one_token_per_character_and_round_trips(tmp_path):
    built = char_tokenizer()
    # What the actor, the trainer and TRL load is the saved tokenizer of a qwen2 model directory
    # (for which transformers picks Qwen2's tokenizer class): it must encode the same.
    built.save_pretrained(tmp_path)
    tiny_model.qwen2_config(len(built), eos_token_id=built.eos_token_id).save_pretrained(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    train, test = tiny_model.make_problems(0)
    for p in train[:300] + test:
        text = p["prompt"] + p["answer"]
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == built.encode(text, add_special_tokens=False)
        assert len(ids) == len(text) and tok.decode(ids) == text
    assert len(tok) == len(set(ALPHABET)) + 3
    assert tok.decode([*tok.encode("42", add_special_tokens=False), tok.eos_token_id], skip_special_tokens=True) == "42"


def test_members_differ_in_tokenizer_shape_recipe_seed_and_start_and_can_be_built_by_name():
    assert {m.tokenizer for m in FAMILY} == {"byte", "char"}
    assert len({(m.hidden, m.layers, m.steps is None) for m in FAMILY}) == len(FAMILY)
    assert len({m.seed_offset for m in FAMILY}) == len(FAMILY)
    assert {m.tokenizer for m in FAMILY if m.steps is not None} == {"byte", "char"}  # the brief recipe
    starts = sorted(m.start_accuracy for m in FAMILY if m.steps is None)
    assert starts[0] <= 0.1 and starts[-1] >= 0.5
    assert {m.name for m in FAMILY} <= set(BUILT)
    for m in FAMILY:
        # The head sizes vLLM's CPU attention supports (its CPU backend rejects 16 or 24 at start-up).
        assert m.hidden // m.heads in (32, 64, 96, 128) and m.heads % m.kv_heads == 0
        tok = tiny_model.make_tokenizer() if m.tokenizer == "byte" else char_tokenizer()
        model = tiny_model.make_model(
            len(tok),
            tok.eos_token_id,
            tok.pad_token_id,
            hidden=m.hidden,
            layers=m.layers,
            heads=m.heads,
            kv_heads=m.kv_heads,
        )
        assert model.config.num_hidden_layers == m.layers and model.config.vocab_size == len(tok)


def test_a_fresh_member_is_the_recipe_from_another_seed_and_is_found_by_name():
    from pipeline_rl.demo import buildable
    from pipeline_rl.demo.family import BY_NAME, fresh, member

    base = BY_NAME["family_char_brief"]
    made = fresh(base, 7)
    assert made.name == "family_char_brief_s7" and member(made.name) == made
    assert made.seed_offset != base.seed_offset and made.seed_offset not in {m.seed_offset for m in FAMILY}
    assert (made.hidden, made.layers, made.tokenizer, made.steps, made.lr) == (
        base.hidden,
        base.layers,
        base.tokenizer,
        base.steps,
        base.lr,
    )
    assert buildable(made.name) and not buildable("family_char_brief_s0") and not buildable("nothing_s3")
    assert member("family_char_base") is BY_NAME["family_char_base"]
