import pytest
import torch
from voltserve.services.executor.generate import main

from tests.checkpoints import checkpoint


def test_generate_prints_greedy_text(capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = checkpoint("qwen2")
    prompts = ["The quick brown fox", "Hello! How are you"]
    argv = ["--model", str(path), "--max-tokens", "8", "--device", "cpu", "--dtype", "float32"]
    for p in prompts:
        argv += ["--prompt", p]
    main(argv + ["--ignore-eos", "--stats"])
    captured = capsys.readouterr()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    for p in prompts:
        ids = torch.tensor([tok(p)["input_ids"]])
        with torch.no_grad():
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False
            )
        text = tok.decode(out[0, ids.shape[1] :].tolist(), skip_special_tokens=True)
        assert text in captured.out
    assert "16 tokens" in captured.err


def test_generate_rejects_bad_params():
    with pytest.raises(SystemExit, match="temperature"):
        main(["--model", str(checkpoint("qwen2")), "--prompt", "x", "--temperature", "5"])
