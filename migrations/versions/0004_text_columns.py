"""bundles.model and bundles.layers as TEXT: PostgreSQL refused VARCHAR(512) overflows only after
the upload (long model ids, many extra layers); SQLite never checked. Publish now checks the
fields that stay bounded before it uploads anything.

Revision ID: 0004
Revises: 0003
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("bundles") as batch:
        batch.alter_column("model", type_=sa.Text(), existing_type=sa.String(512), existing_nullable=True)
        batch.alter_column("layers", type_=sa.Text(), existing_type=sa.String(512), existing_nullable=False)


def downgrade() -> None:
    with op.batch_alter_table("bundles") as batch:
        batch.alter_column("layers", type_=sa.String(512), existing_type=sa.Text(), existing_nullable=False)
        batch.alter_column("model", type_=sa.String(512), existing_type=sa.Text(), existing_nullable=True)
