"""Asks an exported zinc model a question through transformers' generate().

    python3 scripts/demo_generate.py MODEL_DIR "What does the noun \"lantern\" mean?"

The question is rendered with the folder's chat template (as the fine-tune's
data was, python -m zinc.prepare --use-chat-template), the answer decoded
greedily up to 40 new tokens or the end-of-text token. Needs transformers and
torch (bench/peers has a venv with both).
"""
from __future__ import annotations

import sys


def answer(model_dir: str, question: str, max_new_tokens: int = 40) -> str:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    prompt = tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                     add_generation_prompt=True)
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    print(f"Q: {sys.argv[2]}\nA: {answer(sys.argv[1], sys.argv[2])}")
