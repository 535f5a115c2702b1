"""Indexes for an index at fleet scale (100k bundles, 1M events): see docs/index-scale.md.

Each index serves one query shape by its equality columns first, then the column it orders or
ranges on, so PostgreSQL reads the few rows it returns instead of sorting every match. The two prefix-searched
columns use varchar_pattern_ops: a default btree serves LIKE 'abc%' only under the "C" collation, and
PostgreSQL 15 counts neither C.UTF-8 nor en_US.UTF-8 as that (equality still uses the index):

    ix_bundles_key_newest        newest_bundle: bundle_key = ? AND status = ? ORDER BY created_at DESC;
                                 also ls --key PREFIX (bundle_key LIKE 'prefix%')
    ix_bundles_id_prefix         show/yank PREFIX: id LIKE 'prefix%'
    ix_bundles_toolchain_newest  newest_for_toolchain, the same by toolchain_key
    ix_bundles_model_created     ls --model, newest first
    ix_bundles_created           ls, newest first
    ix_events_created            stats --since: every aggregate ranges on created_at
    ix_events_key_created        stats --model: events of one model's bundle keys

The single-column bundle_key, toolchain_key and model indexes are dropped: the composites lead with
the same column, so they answer the same lookups, and a publish maintains three indexes fewer.

Revision ID: 0100_index_scale
Revises: 0002
"""

from alembic import op

revision = "0100_index_scale"
down_revision = "0002"
branch_labels = None
depends_on = None

_NEW = {
    "bundles": {
        "ix_bundles_key_newest": ["bundle_key", "status", "created_at"],
        "ix_bundles_id_prefix": ["id"],
        "ix_bundles_toolchain_newest": ["toolchain_key", "status", "created_at"],
        "ix_bundles_model_created": ["model", "created_at"],
        "ix_bundles_created": ["created_at"],
    },
    "events": {
        "ix_events_created": ["created_at"],
        "ix_events_key_created": ["bundle_key", "created_at"],
    },
}
_REPLACED = {
    "ix_bundles_bundle_key": ["bundle_key"],
    "ix_bundles_toolchain_key": ["toolchain_key"],
    "ix_bundles_model": ["model"],
}


_PATTERN_OPS = {"ix_bundles_key_newest": "bundle_key", "ix_bundles_id_prefix": "id"}


def upgrade() -> None:
    for table, indexes in _NEW.items():
        for name, columns in indexes.items():
            ops = {_PATTERN_OPS[name]: "varchar_pattern_ops"} if name in _PATTERN_OPS else {}
            op.create_index(name, table, columns, postgresql_ops=ops)
    for name in _REPLACED:
        op.drop_index(name, table_name="bundles")


def downgrade() -> None:
    for name, columns in _REPLACED.items():
        op.create_index(name, "bundles", columns)
    for table, indexes in _NEW.items():
        for name in indexes:
            op.drop_index(name, table_name=table)
