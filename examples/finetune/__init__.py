"""LoRA / QLoRA fine-tuning of a Hugging Face-format base, a PEFT adapter out.

    python -m examples.finetune --base <HF dir> --data <file.jsonl> ...

Data: ``template`` reads and checks the JSONL records (prompt/completion or chat messages)
and says which tokens the loss counts; ``data`` tokenizes them with the base's
``tokenizer.json`` and serves packed or padded, labelled batches, batch ``i`` a pure
function of the file, the seed and ``i`` (so a resumed run sees the same data).
"""
