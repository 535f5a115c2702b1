"""Initial index: bundles, packs, blobs, events.

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "bundles",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("bundle_key", sa.String(64), nullable=False),
        sa.Column("toolchain_key", sa.String(64), nullable=False),
        sa.Column("workload_key", sa.String(64), nullable=False),
        sa.Column("model", sa.String(512), nullable=True),
        sa.Column("facts", sa.Text(), nullable=False),
        sa.Column("layers", sa.String(512), nullable=False),
        sa.Column("files", sa.Integer(), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("created_by", sa.String(256), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
    )
    op.create_index("ix_bundles_bundle_key", "bundles", ["bundle_key"])
    op.create_index("ix_bundles_toolchain_key", "bundles", ["toolchain_key"])
    op.create_index("ix_bundles_model", "bundles", ["model"])
    op.create_table(
        "packs",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("condemned_at", sa.DateTime(timezone=True), nullable=True),
    )
    op.create_table(
        "blobs",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("pack_id", sa.String(64), sa.ForeignKey("packs.id"), nullable=False),
        sa.Column("offset", sa.BigInteger(), nullable=False),
        sa.Column("length", sa.BigInteger(), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
    )
    op.create_index("ix_blobs_pack_id", "blobs", ["pack_id"])
    op.create_table(
        "events",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("bundle_key", sa.String(64), nullable=True),
        sa.Column("bundle_id", sa.String(64), nullable=True),
        sa.Column("files", sa.Integer(), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("seconds", sa.Float(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_events_kind_created", "events", ["kind", "created_at"])


def downgrade() -> None:
    op.drop_table("events")
    op.drop_table("blobs")
    op.drop_table("packs")
    op.drop_table("bundles")
