"""The errors of public functions: the function's name apart from the detail, kept by type."""

import copy
import pickle

import pytest

from jaxamp._utils.errors import NamedTypeError, NamedValueError, named, unnamed


def test_named_renames_a_named_error_keeping_its_type_and_data():
    class Found(NamedValueError):
        def __init__(self, detail, fn=None, *, got=None):
            super().__init__(detail, fn)
            self.got = got

    got = object()
    with pytest.raises(Found) as info, named("outer"):
        with named("inner"):
            raise Found("none found", got=got)
    e = info.value
    assert (str(e), e.fn, e.detail, e.got) == (
        "jaxamp.outer: none found",
        "jaxamp.outer",
        "none found",
        got,
    )
    assert unnamed(e) == "none found"
    again = copy.copy(e)
    assert type(again) is Found and str(again) == str(e) and again.got is got


def test_named_names_a_plain_error_once_and_leaves_other_kinds_alone():
    with pytest.raises(NamedValueError, match=r"^jaxamp\.outer: bad$"), named("outer"):
        with named("inner"):
            raise ValueError("bad")
    with (
        pytest.raises(NamedTypeError, match=r"^jaxamp\.f: wrong$"),
        named("f", (TypeError, ValueError)),
    ):
        raise TypeError("wrong")
    with pytest.raises(TypeError, match=r"^wrong$") as info, named("f"):
        raise TypeError("wrong")
    assert type(info.value) is TypeError
    with pytest.raises(NamedTypeError, match=r"^jaxamp\.inner: t$"), named("outer"):
        with named("inner", (TypeError,)):
            raise TypeError("t")  # a TypeError is not the outer block's to rename


def test_a_named_error_survives_pickling():
    e = pickle.loads(pickle.dumps(NamedValueError("detail", "jaxamp.f").renamed("jaxamp.g")))
    assert (type(e), str(e), e.args) == (
        NamedValueError,
        "jaxamp.g: detail",
        ("detail", "jaxamp.g"),
    )
