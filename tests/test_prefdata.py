"""Preference data (DPO): formats from real files, each check with row numbers, hostile rows, what the real
trl.DPOTrainer makes of the normalized pairs, and the demo's pairs and preference accuracy."""

import json

import pytest

from core.demo.toy import build_tokenizer, tiny_config
from core.recipe.data import DataError
from core.recipe.prefcheck import check_pairs
from core.recipe.prefdata import (
    detect_pref_format,
    load_pref_rows,
    normalize_pairs,
    pair_token_ids,
    pairs_dataset,
    preview_pairs,
)


def U(text):
    return {"role": "user", "content": text}


def A(text):
    return {"role": "assistant", "content": text}


def jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def by_check(findings, check):
    found = [f for f in findings if f.check == check]
    assert found, f"no {check} finding in {[str(f) for f in findings]}"
    assert len(found) == 1, [str(f) for f in found]
    return found[0]


def checks(findings):
    return {f.check for f in findings}


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


GOOD = {"prompt": "Q: hi\nA:", "chosen": " HI!", "rejected": " HI"}
GOOD_CHAT = {"chosen": [U("hi"), A("HI!")], "rejected": [U("hi"), A("HI")]}


# ---- formats from files -------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["jsonl", "json", "csv", "parquet"])
def test_standard_pairs_from_every_file_kind(tmp_path, kind):
    import datasets

    rows = [GOOD, {"prompt": "Q: yo\nA:", "chosen": " YO!", "rejected": " YO"}]
    path = tmp_path / f"pairs.{kind}"
    if kind == "jsonl":
        jsonl(path, rows)
    elif kind == "json":
        path.write_text(json.dumps(rows), encoding="utf-8")
    else:
        ds = datasets.Dataset.from_list(rows)
        if kind == "csv":
            ds.to_csv(str(path), index=False)
        else:
            ds.to_parquet(str(path))
    ds = load_pref_rows({"path": str(path)})
    assert detect_pref_format(ds) == "standard"
    assert normalize_pairs(ds) == rows


@pytest.mark.parametrize("kind", ["jsonl", "json"])
def test_conversational_pairs_with_and_without_prompt(tmp_path, kind):
    rows = [
        GOOD_CHAT,  # implicit prompt: the shared first message
        {"prompt": [U("hi")], "chosen": [A("HI!")], "rejected": [A("HI")]},  # explicit
        {"prompt": [U("hi")], "chosen": [U("hi"), A("HI!")], "rejected": [U("hi"), A("HI")]},  # repeated
        {"prompt": "hi", "chosen": [A("HI!")], "rejected": [A("HI")]},  # the prompt as text
    ]
    path = tmp_path / f"chat.{kind}"
    if kind == "jsonl":
        jsonl(path, rows)
    else:
        path.write_text(json.dumps(rows), encoding="utf-8")
    ds = load_pref_rows({"path": str(path)})
    assert detect_pref_format(ds) == "conversational"
    expected = {"prompt": [U("hi")], "chosen": [A("HI!")], "rejected": [A("HI")]}
    assert normalize_pairs(ds) == [expected] * 4
    # a multi-turn implicit prompt keeps everything up to the first difference
    multi = {"chosen": [U("a"), A("b"), U("c"), A("D!")], "rejected": [U("a"), A("b"), U("c"), A("D")]}
    assert normalize_pairs([multi])[0]["prompt"] == [U("a"), A("b"), U("c")]


def test_columns_are_renamed_with_data_columns(tmp_path):
    path = jsonl(tmp_path / "p.jsonl", [{"question": "Q", "better": "a", "worse": "b"}])
    with pytest.raises(DataError, match="data.columns"):
        detect_pref_format(load_pref_rows({"path": str(path)}))
    ds = load_pref_rows(
        {"path": str(path), "columns": {"prompt": "question", "chosen": "better", "rejected": "worse"}}
    )
    assert normalize_pairs(ds) == [{"prompt": "Q", "chosen": "a", "rejected": "b"}]


def test_bad_jsonl_line_is_named_by_the_shared_loader(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(GOOD) + "\n{not json\n", encoding="utf-8")
    with pytest.raises(DataError, match="line 2"):
        load_pref_rows({"path": str(path)})


def test_format_errors_are_one_sentence(tok):
    with pytest.raises(DataError, match="'prompt' column"):
        detect_pref_format([{"chosen": "a", "rejected": "b"}])
    with pytest.raises(DataError, match="neither|no row"):
        detect_pref_format([{"chosen": 5, "rejected": 6}])
    with pytest.raises(DataError, match="not a preference format"):
        detect_pref_format([GOOD], "alpaca")
    f = by_check(check_pairs([{"a": 1}], tok, 64), "columns")
    assert f.level == "error" and "chosen" in f.message
    assert by_check(check_pairs([], tok, 64), "data").level == "error"


# ---- each check ---------------------------------------------------------------------------------------------


def test_clean_pairs_have_no_findings(tok):
    assert check_pairs([GOOD] * 3, tok, 64, tiny_config()) == []
    assert check_pairs([GOOD_CHAT] * 3, tok, 64, tiny_config()) == []


def test_empty_chosen_or_rejected(tok):
    rows = [GOOD, {**GOOD, "chosen": "  "}, GOOD, {**GOOD, "rejected": ""}]
    f = by_check(check_pairs(rows, tok, 64), "empty_pairs")
    assert f.level == "error" and f.rows == [2, 4] and "rows 2, 4" in f.message
    chat = [GOOD_CHAT, {"chosen": [U("hi"), A(" ")], "rejected": [U("hi"), A("HI")]}]
    assert by_check(check_pairs(chat, tok, 64), "empty_pairs").rows == [2]


def test_identical_pairs_warn_and_all_identical_is_an_error(tok):
    same = {**GOOD, "rejected": GOOD["chosen"]}
    f = by_check(check_pairs([GOOD, same], tok, 64), "identical_pairs")
    assert f.level == "warning" and f.rows == [2]
    f = by_check(check_pairs([same, same], tok, 64), "identical_pairs")
    assert f.level == "error" and f.rows == [1, 2] and "all of them" in f.message
    chat_same = {"chosen": [U("hi"), A("x")], "rejected": [U("hi"), A("x")]}
    assert by_check(check_pairs([GOOD_CHAT, chat_same], tok, 64), "identical_pairs").rows == [2]
    one_message = {"chosen": [A("x")], "rejected": [A("x")]}
    assert by_check(check_pairs([GOOD_CHAT, one_message], tok, 64), "identical_pairs").rows == [2]


def test_prompt_filling_max_length_is_an_error(tok):
    long = {**GOOD, "prompt": "Q" * 40}  # char tokenizer: 40 tokens
    f = by_check(check_pairs([GOOD, long], tok, 40), "prompt_too_long")
    assert f.level == "error" and f.rows == [2] and "40" in f.message
    assert "prompt_too_long" not in checks(check_pairs([GOOD, long], tok, 41))


def test_truncation_and_pairs_cut_to_the_same_tokens_warn(tok):
    cut = {"prompt": "Q" * 10, "chosen": "a" * 30, "rejected": "b"}
    same_start = {"prompt": "Q" * 10, "chosen": "a" * 30 + "1", "rejected": "a" * 30 + "2"}
    findings = check_pairs([GOOD, cut, same_start], tok, 32)
    f = by_check(findings, "truncation")
    assert f.level == "warning" and f.rows == [2, 3]
    f = by_check(findings, "truncated_identical")
    assert f.level == "warning" and f.rows == [3]
    assert not {"truncation", "truncated_identical"} & checks(check_pairs([GOOD, cut, same_start], tok, 64))


def test_token_ids_beyond_the_models_vocab(tok):
    # the char tokenizer's highest id (101) is the space: a model with 101 embeddings cannot take it
    assert tok(" ")["input_ids"] == [101]
    ok, spaced = (
        {"prompt": "Q:", "chosen": "A", "rejected": "B"},
        {"prompt": "Q:", "chosen": "A B", "rejected": "B"},
    )
    f = by_check(check_pairs([ok, spaced], tok, 64, tiny_config(vocab_size=101)), "vocab")
    assert f.level == "error" and f.rows == [2] and "vocab_size 101" in f.message
    assert "vocab" not in checks(check_pairs([ok, spaced], tok, 64, tiny_config()))


def test_position_limits(tok):
    conf = tiny_config(max_position_embeddings=32)
    f = by_check(check_pairs([GOOD], tok, 64, conf), "position_limit")
    assert f.level == "error" and "max_position_embeddings 32" in f.message
    long = {**GOOD, "chosen": "x" * 40}
    f = by_check(check_pairs([GOOD, long], tok, 30, conf), "position_limit")
    assert f.level == "warning" and f.rows == [2]


def test_missing_keys_and_wrong_types_name_row_and_key(tok):
    rows = [GOOD, {"prompt": "Q", "rejected": "b", "chosen": None}, {**GOOD, "rejected": ["a", "b"]}]
    findings = check_pairs(rows, tok, 64)
    f = by_check(findings, "missing_keys")
    assert f.level == "error" and f.rows == [2] and "Row 2 has no 'chosen'" in f.message
    f = by_check(findings, "wrong_types")
    assert f.rows == [3] and "Row 3: 'rejected' is a list" in f.message and "make it a string" in f.message
    chat = [GOOD_CHAT, {"chosen": [U("hi"), {"role": "assistant"}], "rejected": [U("hi"), A("x")]}]
    f = by_check(check_pairs(chat, tok, 64), "wrong_types")
    assert f.rows == [2] and "message 2 of 'chosen'" in f.message
    chat = [GOOD_CHAT, {"chosen": "text", "rejected": [U("hi"), A("x")]}]
    assert by_check(check_pairs(chat, tok, 64), "wrong_types").rows == [2]
    with pytest.raises(DataError, match=r"^Row 2 has no 'chosen'"):
        normalize_pairs(rows)


def test_conversations_without_a_shared_prompt(tok):
    rows = [GOOD_CHAT, {"chosen": [U("a"), A("x")], "rejected": [U("b"), A("y")]}]
    f = by_check(check_pairs(rows, tok, 64), "no_prompt")
    assert f.level == "error" and f.rows == [2] and "'prompt' column" in f.fix
    with pytest.raises(DataError, match="Row 2"):
        normalize_pairs(rows)


def test_tokenizer_requirements(tok):
    plain = build_tokenizer(chat_template=False)
    assert by_check(check_pairs([GOOD_CHAT], plain, 64), "chat_template").level == "error"
    no_eos = build_tokenizer()
    no_eos.eos_token = None
    assert by_check(check_pairs([GOOD], no_eos, 64), "eos").level == "error"
    picky = build_tokenizer()
    picky.chat_template = "{{ raise_exception('roles must alternate') }}"
    f = by_check(check_pairs([GOOD_CHAT], picky, 64), "format")
    assert f.rows == [1] and "roles must alternate" in f.message


def test_hostile_rows_give_sentences_not_tracebacks(tok):
    deep: list = []
    for _ in range(5000):
        deep = [deep]
    huge = "x" * 1_000_000
    rows = [
        GOOD,
        5,
        None,
        b"\x00\xff\xfe",
        "just text",
        {"prompt": "Q", "chosen": {"a": [1, [2, [3, [4]]]]}, "rejected": "b"},
        {"prompt": "Q", "chosen": deep, "rejected": "b"},
        {"prompt": "Q", "chosen": huge, "rejected": "b"},
        {"prompt": "Q", "chosen": b"\x00binary", "rejected": "b"},
        {"prompt": "Q", "chosen": "nul\x00 and \udcff", "rejected": "b"},
        {"prompt": "Q", "chosen": True, "rejected": "b"},
    ]
    findings = check_pairs(rows, tok, 64)
    assert by_check(findings, "row_type").rows == [2, 3, 4, 5]
    assert by_check(findings, "wrong_types").rows == [6, 7, 9, 11]
    assert by_check(findings, "truncation").rows == [8]
    for f in findings:
        assert "Traceback" not in f.message and len(f.message) < 1000, f.message
    with pytest.raises(DataError, match=r"^Row 2 is a number \(5\)"):
        normalize_pairs(rows)
    preview = preview_pairs(rows, n=20, width=50)
    assert [p["row"] for p in preview] == list(range(1, 12))
    assert preview[0]["problem"] is None and preview[0]["chosen"] == " HI!"
    assert preview[3]["problem"].startswith("Row 4 is binary data")
    assert len(preview[7]["chosen"]) <= 50 and preview[7]["problem"] is None
    assert "\x00" not in preview[9]["chosen"]
    for p in preview[1:7] + [preview[8], preview[10]]:
        assert p["problem"] and len(p["problem"]) < 300, p


def test_preview_shows_pairs_side_by_side(tok):
    preview = preview_pairs([GOOD_CHAT, {**GOOD_CHAT, "chosen": [U("hi"), A("long " * 200)]}], width=40)
    assert preview[0] == {
        "row": 1,
        "prompt": "user: hi",
        "chosen": "assistant: HI!",
        "rejected": "assistant: HI",
        "problem": None,
    }
    assert len(preview[1]["chosen"]) <= 40 and " … " in preview[1]["chosen"]


# ---- the real DPOTrainer ------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["standard", "conversational"])
def test_dpo_trainer_accepts_the_pairs_and_tokenizes_them_like_pair_token_ids(tiny_llama, tmp_path, fmt):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    if fmt == "standard":
        rows = [
            GOOD,
            {"prompt": "Q: abc\nA:", "chosen": " ABC!", "rejected": " ABC"},
            {**GOOD, "prompt": "Q" * 30},
        ]
    else:
        rows = [
            GOOD_CHAT,
            {"prompt": "abc", "chosen": [A("ABC!")], "rejected": [A("ABC")]},
            {"chosen": [U("Q" * 30), A("a")], "rejected": [U("Q" * 30), A("b")]},
        ]
    pairs = normalize_pairs(rows)
    max_length = 30
    assert by_check(check_pairs(rows, tokenizer, max_length), "prompt_too_long").rows == [3]
    args = DPOConfig(
        output_dir=str(tmp_path / "out"),
        max_length=max_length,
        per_device_train_batch_size=2,
        max_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        logging_steps=1,
    )
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    trainer = DPOTrainer(
        model=model, args=args, train_dataset=pairs_dataset(pairs), processing_class=tokenizer
    )
    prepared = trainer.train_dataset
    assert len(prepared) == 2  # the row check_pairs reports as prompt_too_long is the one DPOTrainer drops
    for i in range(2):
        ours = pair_token_ids(pairs[i], tokenizer)
        assert (prepared[i]["prompt_ids"], prepared[i]["chosen_ids"], prepared[i]["rejected_ids"]) == tuple(
            map(list, ours)
        )
    trainer.train()  # one real DPO step on these pairs
    assert any("loss" in m for m in trainer.state.log_history)


# ---- the demo's pairs and preference accuracy ---------------------------------------------------------------


def test_demo_pairs_are_deterministic_held_out_and_clean(tmp_path, tok):
    from core.demo.build import encode_chat_pairs, task_rows
    from core.demo.prefs import HELDOUT_PAIRS, TRAIN_PAIRS, read_pairs, write_pref_data

    train_a, held_a = write_pref_data(tmp_path / "a")
    train_b, held_b = write_pref_data(tmp_path / "b")
    assert train_a.read_bytes() == train_b.read_bytes() and held_a.read_bytes() == held_b.read_bytes()
    train, held = read_pairs(train_a), read_pairs(held_a)
    assert (len(train), len(held)) == (TRAIN_PAIRS, HELDOUT_PAIRS)
    ds = load_pref_rows({"path": str(train_a)})
    assert detect_pref_format(ds) == "standard"

    def words(pairs):
        return {p["rejected"].lower() for p in pairs}

    sft_train, sft_held = task_rows()
    sft_words = {r["messages"][1]["content"].lower() for r in sft_train} | {
        r["answer"].lower() for r in sft_held
    }
    assert not words(train) & words(held) and not (words(train) | words(held)) & sft_words
    assert all(p["chosen"] == p["rejected"] + "!" and p["rejected"].isupper() for p in train + held)
    # the demo tokenizer represents the chosen style ('!' is no <unk>) and the demo's length fits every pair
    assert tok.unk_token_id not in tok("ABCDE!")["input_ids"]
    conf = tiny_config("llama", max_position_embeddings=64)
    assert check_pairs(train + held, tok, 32, conf) == []
    # the prompt + rejected answer are exactly the tokens the SFT run trained on for this word
    pair = train[0]
    p, _c, r = pair_token_ids(pair, tok)
    sft = encode_chat_pairs(tok, [(f"Uppercase: {pair['rejected'].lower()}", pair["rejected"])])[0]
    assert p + r == sft["input_ids"] and sum(x != -100 for x in sft["labels"]) == len(r)


class _Prefers:
    """A stand-in causal LM whose next token is always `token_id` with probability ~1."""

    def __init__(self, token_id: int, vocab: int = 102):
        import torch

        self.token_id, self.vocab, self.training = token_id, vocab, False
        self._p = torch.nn.Parameter(torch.zeros(1))

    def parameters(self):
        return iter([self._p])

    def eval(self):
        self.training = False

    def train(self, mode=True):
        self.training = mode

    def __call__(self, input_ids, attention_mask):
        import torch

        logits = torch.zeros(*input_ids.shape, self.vocab)
        logits[..., self.token_id] = 20.0
        return type("Out", (), {"logits": logits})()


def test_preference_accuracy_counts_pairs_the_model_prefers(tok):
    from core.demo.prefs import preference_accuracy

    a = tok.convert_tokens_to_ids("A")
    pairs = [{"prompt": "Q", "chosen": "A" * k, "rejected": "z" * k} for k in (1, 2, 5)]
    model = _Prefers(a)
    assert preference_accuracy(model, tok, pairs, batch_size=2) == 1.0
    swapped = [{**p, "chosen": p["rejected"], "rejected": p["chosen"]} for p in pairs]
    assert preference_accuracy(model, tok, swapped) == 0.0
    assert preference_accuracy(model, tok, []) == 0.0
    assert model.training is False  # the mode is restored


def test_pair_logps_batched_equals_one_by_one(tiny_llama, tok):
    import torch
    from transformers import AutoModelForCausalLM

    from core.demo.prefs import pair_logps

    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    model.train()
    longer = {"prompt": "Q: a much longer prompt here\nA:", "chosen": " x", "rejected": " a longer answer"}
    pairs = normalize_pairs([GOOD, longer]) + normalize_pairs([GOOD_CHAT])
    batched = pair_logps(model, tok, pairs, batch_size=6)
    single = pair_logps(model, tok, pairs, batch_size=1)
    assert torch.allclose(torch.tensor(batched), torch.tensor(single), atol=1e-4)
    # by hand for the first pair's chosen answer
    p, c, _r = pair_token_ids(pairs[0], tok)
    with torch.no_grad():
        logits = model(torch.tensor([p + c])).logits[0]
    by_hand = sum(torch.log_softmax(logits[len(p) - 1 + i], -1)[t].item() for i, t in enumerate(c))
    assert abs(batched[0][0] - by_hand) < 1e-4
    assert model.training  # restored


def test_chosen_accuracy_is_the_greedy_answer_matching_chosen(tiny_llama, tok):
    import torch
    from transformers import AutoModelForCausalLM

    from core.demo.prefs import chosen_accuracy

    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    prompts = ["Q: hi\nA:", "Q: a longer one\nA:", "Q: yo\nA:"]
    greedy = []
    for prompt in prompts:  # one by one, unbatched: what the model says
        ids = tok(prompt, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
        greedy.append(tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
    pairs = [{"prompt": p, "chosen": g, "rejected": "zz"} for p, g in zip(prompts, greedy, strict=True)]
    assert chosen_accuracy(model, tok, pairs, max_new_tokens=4) == 1.0
    wrong = [{**p, "chosen": p["chosen"] + "#"} for p in pairs]
    assert chosen_accuracy(model, tok, wrong, max_new_tokens=4) == 0.0
