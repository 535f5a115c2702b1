from hypothesis import given
from hypothesis import strategies as st

from kcache import canonical

values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


@given(st.dictionaries(st.text(max_size=10), values, max_size=8))
def test_canonical_bytes_ignore_key_order(doc):
    reordered = dict(reversed(list(doc.items())))
    assert canonical.dumps(doc) == canonical.dumps(reordered)
    assert canonical.xxh3(doc) == canonical.xxh3(reordered)


def test_canonical_form_is_compact_and_sorted():
    assert canonical.dumps({"b": 1, "a": [1, "é"]}) == '{"a":[1,"é"],"b":1}'.encode()
