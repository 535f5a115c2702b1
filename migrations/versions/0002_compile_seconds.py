"""bundles.compile_seconds: the cold compile time a bundle saves, as its publisher measured it.

Nullable: bundles published before this column, or without --compile-seconds, have no estimate,
and stats count their hits as "no estimate" rather than as zero seconds saved.

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # batch mode: SQLite cannot alter tables in place; on PostgreSQL this is a plain ADD COLUMN.
    with op.batch_alter_table("bundles") as batch:
        batch.add_column(sa.Column("compile_seconds", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("bundles") as batch:
        batch.drop_column("compile_seconds")
