"""Whether an output is valid JSON for its schema, as the benchmarks and acceptance studies judge it."""
from __future__ import annotations

import json
from decimal import Decimal


def check_output(schema, text: str) -> tuple[str, bool | None]:
    """(status, format-valid): status valid | invalid | unparsable | schema_error | unchecked."""
    status, fmt, _ = explain_output(schema, text)
    return status, fmt


def _decimal_multiple_of(validator, divisor, instance, schema):
    """jsonschema's multipleOf divides binary floats (10000.89 / 0.01 is not whole there): compare the decimals
    the JSON text wrote instead."""
    import jsonschema
    if validator.is_type(instance, "number") and Decimal(repr(instance)) % Decimal(repr(divisor)) != 0:
        yield jsonschema.ValidationError(f"{instance!r} is not a multiple of {divisor!r}")


def explain_output(schema, text: str) -> tuple[str, bool | None, str | None]:
    """check_output plus the first validation error's message (invalid outputs only)."""
    try:
        import jsonschema
    except ImportError:
        return "unchecked", None, None
    try:
        value = json.loads(text)
    except ValueError:
        return "unparsable", False, None
    try:
        cls = jsonschema.validators.validator_for(schema)
        cls.check_schema(schema)
        cls = jsonschema.validators.extend(cls, {"multipleOf": _decimal_multiple_of})
        error = next(cls(schema).iter_errors(value), None)
        fmt = error is None and next(cls(schema, format_checker=cls.FORMAT_CHECKER).iter_errors(value), None) is None
    except Exception:                     # noqa: BLE001 - SchemaError, Unresolvable, re.error: the schema's fault
        return "schema_error", None, None
    if error is None:
        return "valid", fmt, None
    return "invalid", fmt, (f"{error.validator} at {'/'.join(map(str, error.absolute_path)) or '(root)'}: "
                            f"{error.message[:120]}")
