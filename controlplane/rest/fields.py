"""Field rules every app's serializers share: JSON types as the schema states them, no NUL or lone
surrogates in strings, and the shape of an error body."""
from __future__ import annotations

from django.core.validators import RegexValidator
from rest_framework import serializers

NOT_BLANK = RegexValidator(r"^[^\x00\ud800-\udfff]*[^\s\x00\ud800-\udfff][^\x00\ud800-\udfff]*$",
                           "must contain a visible character, and no NUL or surrogate characters")
NO_NUL = RegexValidator(r"^[^\x00\ud800-\udfff]*$", "must not contain NUL or surrogate characters")


class StrictJSONTypes:
    """JSON bodies must carry the types the schema states: DRF would accept "5" for an integer, 1 for a
    boolean or 0 for a string, which the OpenAPI schema does not allow (and schemathesis checks)."""

    def to_internal_value(self, data):
        if isinstance(data, dict):
            errors = {}
            for name, field in self.fields.items():
                if field.read_only or name not in data:
                    continue
                msg = _type_error(field, data[name])
                if msg:
                    errors[name] = [msg]
            if errors:
                raise serializers.ValidationError(errors)
        return super().to_internal_value(data)


def _type_error(field, value):
    if value is None:
        return None if field.allow_null else None  # DRF's own null handling reports it
    is_num = isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(field, serializers.BooleanField):
        return None if isinstance(value, bool) else "Must be true or false."
    if isinstance(field, serializers.IntegerField) or isinstance(field, serializers.PrimaryKeyRelatedField):
        return None if isinstance(value, int) and not isinstance(value, bool) else "Must be an integer."
    if isinstance(field, serializers.FloatField):
        return None if is_num else "Must be a number."
    if isinstance(field, (serializers.CharField, serializers.ChoiceField)):
        return None if isinstance(value, str) else "Must be a string."
    if isinstance(field, serializers.DictField):
        return None if isinstance(value, dict) else "Must be an object."
    if isinstance(field, serializers.ListField):
        if not isinstance(value, list):
            return "Must be an array."
        for item in value:
            msg = _type_error(field.child, item)
            if msg:
                return f"Item: {msg}"
    return None


class ErrorSerializer(serializers.Serializer):
    detail = serializers.CharField()
    code = serializers.CharField(required=False)
    state = serializers.CharField(required=False)
