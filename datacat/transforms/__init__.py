"""Transforms: one raw record to one training sample (decode, resize, augment, caption) and the bad-sample ledger."""
