"""What every protocol model shares: strict JSON types, unknown fields rejected, null = absent."""
from __future__ import annotations

from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    PlainValidator,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    model_validator,
)

NULL_IS_ABSENT = "A null value for any field means the same as leaving the field out."


class ProtocolModel(BaseModel):
    """A JSON object of the OpenAI protocol.

    strict: JSON types are not coerced ("5" is no integer, "yes" no boolean, 2.0 no integer);
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


class ResponseModel(BaseModel):
    """A JSON object the server sends: documents (and in tests checks) the response shapes."""
    model_config = ConfigDict(extra="forbid", strict=True)


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
    per alternative, under locations that name the alternatives' types, not JSON paths.)"""
    adapters = [TypeAdapter(t) for t in types]

    def validate(value):
        for adapter in adapters:
            try:
                return adapter.validate_python(value, strict=True)
            except ValidationError:
                continue
        raise ValueError(f"must be {description}")

    union = types[0]
    for t in types[1:]:
        union = union | t
    return Annotated[union, PlainValidator(validate, json_schema_input_type=union)]
