#!/usr/bin/env python3
"""Loads a model directory with transformers and prints the loss of a token JSONL file as one
batch, as `moeforge eval --json` computes it (rows of equal length; labels -100 ignored, HF's
shift; the aux loss added when the config sets output_router_logits). Used to check that what
moeforge writes loads in transformers and gives the same loss there."""
import json
import sys

import torch
from transformers import AutoModelForCausalLM


def main():
    model_dir, data = sys.argv[1], sys.argv[2]
    rows = [json.loads(l) for l in open(data) if l.strip()]
    ids = torch.tensor([r["input_ids"] for r in rows])
    labels = torch.tensor([r.get("labels", r["input_ids"]) for r in rows])
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager",
                                                 experts_implementation="eager")
    model.eval()
    with torch.no_grad():
        out = model(input_ids=ids, labels=labels)
    aux = getattr(out, "aux_loss", None)  # None for models without a load-balancing loss (nemotron_h)
    aux = float(aux) if aux is not None else 0.0
    print(json.dumps({"loss": float(out.loss), "aux_loss": aux, "tokens": int((labels[:, 1:] != -100).sum())}))


if __name__ == "__main__":
    main()
