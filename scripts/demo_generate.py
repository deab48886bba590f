"""Asks an exported zinc model a question through transformers' generate().

    python3 scripts/demo_generate.py MODEL_DIR "What does the noun \"lantern\" mean?"
    python3 scripts/demo_generate.py BASE_DIR QUESTION --adapter ADAPTER_DIR   # LoRA, through peft.PeftModel

The question is rendered with the folder's chat template (as the fine-tune's
data was, python -m zinc.prepare --use-chat-template), the answer decoded
greedily up to 40 new tokens or the end-of-text token. Needs transformers and
torch (bench/peers has a venv with both; --adapter needs peft too, which it
has).
"""
from __future__ import annotations

import sys


def answer(model_dir: str, question: str, max_new_tokens: int = 40, adapter: str | None = None) -> str:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    prompt = tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                     add_generation_prompt=True)
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()


if __name__ == "__main__":
    args = sys.argv[1:]
    adapter = None
    if len(args) == 4 and args[2] == "--adapter":
        adapter = args[3]
        args = args[:2]
    if len(args) != 2:
        sys.exit(__doc__)
    print(f"Q: {args[1]}\nA: {answer(args[0], args[1], adapter=adapter)}")
