"""Guided decoding: grammar-mask cost, output quality on JSON schemas and the schema rewrite."""
