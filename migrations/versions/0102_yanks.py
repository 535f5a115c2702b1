"""yanks: the ids of yanked bundles gc deleted, so that a copy of one put back in the store is
still yanked for pods pinned to it and in its key's signed ref.

Revision ID: 0102_yanks
Revises: 0101_publish_leases
"""

import sqlalchemy as sa
from alembic import op

revision = "0102_yanks"
down_revision = "0101_publish_leases"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "yanks",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("bundle_key", sa.String(64), nullable=False),
        sa.Column("deleted_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_yanks_bundle_key", "yanks", ["bundle_key"])


def downgrade() -> None:
    op.drop_index("ix_yanks_bundle_key", table_name="yanks")
    op.drop_table("yanks")
