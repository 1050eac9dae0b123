"""A step's tokens from its logits: greedy argmax and the grammar bitmask."""
