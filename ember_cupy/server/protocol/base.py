"""What every protocol model shares: strict JSON types, unknown fields rejected, null = absent."""
from __future__ import annotations

from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BeforeValidator,
    BaseModel,
    ConfigDict,
    ValidationError,
    ValidationInfo,
    WrapValidator,
    model_validator,
)

NULL_IS_ABSENT = "A null value for any field means the same as leaving the field out."


class ProtocolModel(BaseModel):
    """A JSON object of the OpenAI protocol.

    strict: JSON types are not coerced ("5" is no integer, "yes" no boolean); integer fields are
    `Integer`, which takes an integral number such as 1.0 as JSON Schema and vLLM do;
    extra="forbid": an unknown field is an error naming it, as OpenAI answers;
    a field sent as null is treated as not sent (clients send `"stop": null` for "no stop").
    """
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls(cls, data: Any) -> Any:
        if isinstance(data, dict) and any(value is None for value in data.values()):
            return {key: value for key, value in data.items() if value is not None}
        return data


def integral_float_as_int(value: Any) -> Any:
    """1.0 -> 1 (JSON Schema counts 1.0 as an integer); 1.5, "1" and true stay for strict int
    to refuse."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


Integer = Annotated[int, BeforeValidator(integral_float_as_int)]


class ResponseModel(BaseModel):
    """A JSON object the server sends: documents (and in tests checks) the response shapes."""
    model_config = ConfigDict(extra="forbid", strict=True)


def present(field: str) -> dict:
    """JSON Schema for "the object has `field`, not null" (null counts as absent here)."""
    return {"required": [field], "properties": {field: {"not": {"type": "null"}}}}


def vocab_size(info: ValidationInfo) -> int | None:
    """The model's vocabulary size when validating a request for it (None: shape only)."""
    return (info.context or {}).get("vocab_size")


def check_token_ids(ids, info: ValidationInfo, what: str) -> None:
    size = vocab_size(info)
    if size is None:
        return
    bad = [t for t in ids if not 0 <= t < size]
    if bad:
        raise ValueError(f"{what} {bad[:5]} are outside the vocabulary [0, {size})")


def one_of(description: str, *types):
    """A field that is any one of `types` (e.g. a string or an array of strings), with ONE error
    message naming the field when it is none of them. (pydantic's own unions report one error
    per alternative, under locations that name the alternatives' types, not JSON paths.)
    The union itself stays the field's schema, so serialization and the JSON Schema know each
    alternative (a plain validator would leave the serializer guessing: warnings on dump)."""
    def validate(value, handler):
        try:
            return handler(value)
        except ValidationError:
            raise ValueError(f"must be {description}") from None

    union = types[0]
    for t in types[1:]:
        union = union | t
    return Annotated[union, WrapValidator(validate)]


# OpenAI's bounds on `metadata`: 16 pairs, keys of at most 64 characters, values of at most 512
METADATA_MAX_PAIRS = 16
METADATA_MAX_KEY_CHARS = 64
METADATA_MAX_VALUE_CHARS = 512


def check_metadata(metadata: dict[str, str]) -> dict[str, str]:
    if len(metadata) > METADATA_MAX_PAIRS:
        raise ValueError(f"at most {METADATA_MAX_PAIRS} key-value pairs, got {len(metadata)}")
    for key, value in metadata.items():
        if len(key) > METADATA_MAX_KEY_CHARS:
            raise ValueError(f"keys have at most {METADATA_MAX_KEY_CHARS} characters, got {len(key)}")
        if len(value) > METADATA_MAX_VALUE_CHARS:
            raise ValueError(f"values have at most {METADATA_MAX_VALUE_CHARS} characters, "
                             f"got {len(value)} (key {key[:METADATA_MAX_KEY_CHARS]!r})")
    return metadata


METADATA_DESCRIPTION = (f"At most {METADATA_MAX_PAIRS} pairs; keys of at most {METADATA_MAX_KEY_CHARS} "
                        f"characters, values of at most {METADATA_MAX_VALUE_CHARS}.")
Metadata = Annotated[dict[str, str], AfterValidator(check_metadata)]
