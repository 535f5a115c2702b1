"""publish_leases: one row per bundle key a publish is uploading for, so that pods of one bundle key
that publish at once upload each pack once (the others wait, then find its blobs in the index).

Revision ID: 0101_publish_leases
Revises: 0100_index_scale
"""

import sqlalchemy as sa
from alembic import op

revision = "0101_publish_leases"
down_revision = "0100_index_scale"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "publish_leases",
        sa.Column("bundle_key", sa.String(64), primary_key=True),
        sa.Column("holder", sa.String(128), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("publish_leases")
