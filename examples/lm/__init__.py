"""A small Llama (dense or Mixtral) trained end to end with rudax: the README's main job.

    python -m examples.lm.prepare   # corpus -> local BPE -> token shards (data/lm)
    python -m examples.lm.train     # prepares if needed, trains, evaluates, checkpoints

Data: ``corpus`` reads a text corpus (by default the Python standard library's own sources)
and splits it by document; ``tokenizer`` trains the byte-level BPE and encodes documents;
``prepare`` builds the data folder (tokenizer, shards, ``prepared.json``) and is its command
line; ``data`` holds the shard format and the deterministic loader the trainer reads from.

Training: ``train`` is the run as named steps (``train()``: ``setup.configure`` and
``setup.open_data``, the model, ``_Trainer``'s state and steps, the loop, the report);
``step`` maps the flags onto the library's recipe (``rudax.models.ModelSpec`` and
``OptimizerSpec``); ``guard`` stops a run that goes wrong.
"""
