"""store_binding: the one store this index describes.

An index answers "which blobs exist" for one store. Used against another, publish would skip
uploads the new store never got, and restore would miss bundles that store's refs name. The
single row (slot 1) holds the store's id from its `kcache-store.json` and the URL it was bound
under (for the error message only: URLs alias, ids do not).

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "store_binding",
        sa.Column("slot", sa.Integer(), primary_key=True, autoincrement=False),
        sa.Column("store_id", sa.String(64), nullable=False),
        sa.Column("store_url", sa.Text(), nullable=False),
        sa.Column("bound_at", sa.DateTime(timezone=True), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("store_binding")
