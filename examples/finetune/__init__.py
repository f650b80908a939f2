"""LoRA / QLoRA fine-tuning of a Hugging Face-format base, a PEFT adapter out.

    python -m examples.finetune --base <HF dir> --data <file.jsonl> ...

``train`` is the run as named steps (``finetune``): ``setup.configure`` (processes, run
directory, flags, base and data found, mesh; nothing written), the data read, the base
loaded with its adapters (``examples.policy.held``), the steps built and a resumed run
restored (``_Tuner``), the loop, and the adapter (and merged model) written. Its flags are
``config``'s, on the adapter programs' shared ones (``examples.policy.config``).

Data: ``template`` reads and checks the JSONL records (prompt/completion or chat messages)
and says which tokens the loss counts; ``data`` tokenizes them with the base's
``tokenizer.json`` and serves packed or padded, labelled batches, batch ``i`` a pure
function of the file, the seed and ``i`` (so a resumed run sees the same data).
"""
