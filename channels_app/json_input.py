"""A JSON body's values keep JSON's types: `"stream": "yes"` is a 400, not a stream.

DRF's fields coerce what they are given: a BooleanField reads "yes", "on", "1" and 1 as true, a CharField
reads 5 as "5", an IntegerField reads "5" as 5. That suits a query string or a form, where every value is
text, but in a JSON body it turns a client's mistake into a request it did not mean (a stream it cannot
read, a model named "5"). Every API input serializer derives from `JsonInput`: when its data is a parsed JSON
object, each field's value must already be of the field's JSON type (null is left to the field's allow_null);
query strings and multipart forms (a QueryDict) are read as before.
"""
from __future__ import annotations

from django.http import QueryDict
from rest_framework import serializers

BOOLEAN = "must be true or false"
STRING = "must be a string"
INTEGER = "must be an integer"
NUMBER = "must be a number"


def _type_error(field: serializers.Field, value):
    """What is wrong with a JSON value's type for this field: a message, a list field's {index: [message]}, or
    None when the type fits (the field's own validation then runs as usual)."""
    if value is None:
        return None
    if isinstance(field, serializers.BooleanField):
        return None if isinstance(value, bool) else BOOLEAN
    if isinstance(field, serializers.CharField):
        return None if isinstance(value, str) else STRING
    if isinstance(field, serializers.IntegerField):  # 1.0 is JSON's 1 written by a client that has only floats
        whole = isinstance(value, float) and value.is_integer()
        return None if (isinstance(value, int) and not isinstance(value, bool)) or whole else INTEGER
    if isinstance(field, (serializers.FloatField, serializers.DecimalField)):
        return None if isinstance(value, (int, float)) and not isinstance(value, bool) else NUMBER
    if isinstance(field, serializers.ListField) and isinstance(value, list) and field.child is not None:
        items = {i: [msg] for i, item in enumerate(value) if (msg := _type_error(field.child, item))}
        return items or None
    return None


class JsonInput(serializers.Serializer):
    """A request serializer whose JSON input is held to JSON's types (module doc)."""

    def to_internal_value(self, data):
        if isinstance(data, dict) and not isinstance(data, QueryDict):
            errors = {}
            for name, field in self.fields.items():
                if not field.read_only and name in data:
                    problem = _type_error(field, data[name])
                    if problem:
                        errors[name] = problem if isinstance(problem, dict) else [problem]
            if errors:
                raise serializers.ValidationError(errors)
        return super().to_internal_value(data)
