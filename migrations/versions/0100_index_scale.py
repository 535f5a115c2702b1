"""Indexes for an index at fleet scale (100k bundles, 1M events): see docs/index-scale.md.

Each bundle index leads with a query's equality columns and ends in its ORDER BY, created_at DESC
then id, exactly, so PostgreSQL reads the rows the query returns and has nothing to sort. With a
partial match (created_at ascending, and an incremental sort for id) the planner judged walking all
bundles newest first cheaper for a key holding many bundles, and read 20k of them when that key's
newest bundle was old. The prefix-searched columns use varchar_pattern_ops: a default B-tree serves
LIKE 'abc%' only under the "C" collation, and PostgreSQL 15 counts neither C.UTF-8 nor en_US.UTF-8 as
that (equality still uses the index):

    ix_bundles_key_newest        newest_bundle: bundle_key = ? AND status = ? ORDER BY created_at DESC, id;
                                 also ls --key PREFIX (bundle_key LIKE 'prefix%')
    ix_bundles_toolchain_newest  newest_for_toolchain, the same by toolchain_key
    ix_bundles_model_created     ls --model, newest first
    ix_bundles_created           ls, newest first
    ix_bundles_id_prefix         show/yank PREFIX: id LIKE 'prefix%'
    ix_events_created            stats --since: every aggregate ranges on created_at
    ix_events_key_created        stats --model: events of one model's bundle keys

The single-column bundle_key, toolchain_key and model indexes are dropped: the composites lead with
the same column, so they answer the same lookups, and a publish maintains three indexes fewer.

Revision ID: 0100_index_scale
Revises: 0004
"""

import sqlalchemy as sa
from alembic import op

revision = "0100_index_scale"
down_revision = "0004"
branch_labels = None
depends_on = None

_NEWEST = [sa.text("created_at DESC"), "id"]


def _pattern_ops(column: str) -> dict:
    return {"postgresql_ops": {column: "varchar_pattern_ops"}}


_NEW = [
    ("bundles", "ix_bundles_key_newest", ["bundle_key", "status", *_NEWEST], _pattern_ops("bundle_key")),
    ("bundles", "ix_bundles_toolchain_newest", ["toolchain_key", "status", *_NEWEST], {}),
    ("bundles", "ix_bundles_model_created", ["model", *_NEWEST], {}),
    ("bundles", "ix_bundles_created", _NEWEST, {}),
    ("bundles", "ix_bundles_id_prefix", ["id"], _pattern_ops("id")),
    ("events", "ix_events_created", ["created_at"], {}),
    ("events", "ix_events_key_created", ["bundle_key", "created_at"], {}),
]
_REPLACED = {
    "ix_bundles_bundle_key": ["bundle_key"],
    "ix_bundles_toolchain_key": ["toolchain_key"],
    "ix_bundles_model": ["model"],
}


def upgrade() -> None:
    for table, name, columns, options in _NEW:
        op.create_index(name, table, columns, **options)
    for name in _REPLACED:
        op.drop_index(name, table_name="bundles")


def downgrade() -> None:
    for name, columns in _REPLACED.items():
        op.create_index(name, "bundles", columns)
    for table, name, _, _ in _NEW:
        op.drop_index(name, table_name=table)
