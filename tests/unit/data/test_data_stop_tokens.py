"""Where generation ends: eos from tokenizer_config.json, generation_config.json's eos_token_id
(an id or a list), and the chat end-of-turn tokens the tokenizer has as special tokens."""

import json

from tokenizers import Tokenizer, models

from areal_jobs.data.tokenizer import load_tokenizer


def model_dir(tmp_path, specials, tokenizer_config=None, generation_config=None):
    tok = Tokenizer(models.WordLevel({"<unk>": 0, "hello": 1}, unk_token="<unk>"))
    tok.add_special_tokens(specials)  # ids 2, 3, ... in this order
    tok.add_tokens(["<|eot_id|>"])  # a plain added token, not special: not a stop token
    tok.save(str(tmp_path / "tokenizer.json"))
    if tokenizer_config is not None:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    if generation_config is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation_config))
    return tmp_path


def test_chatml_instruct_model(tmp_path):
    # <|endoftext|>=2 <|im_start|>=3 <|im_end|>=4; eos is the end of turn, generation_config adds 2
    d = model_dir(tmp_path, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                  {"eos_token": {"content": "<|im_end|>"}}, {"eos_token_id": [2, 4]})  # fmt: skip
    assert load_tokenizer(d).stop_token_ids == (4, 2)


def test_no_configs_and_no_end_of_turn_tokens(tmp_path):
    assert load_tokenizer(model_dir(tmp_path, ["<s>"])).stop_token_ids == ()
    d = model_dir(tmp_path, ["<s>", "</s>"], {"eos_token": "</s>"}, {"eos_token_id": 3})
    assert load_tokenizer(d).stop_token_ids == (3,)
