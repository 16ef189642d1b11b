"""A statement's command tag as PostgreSQL names it (CreateCommandTag in its
tcop/utility.c), read from the statement's parse tree (pglast): the tag event
triggers see, and `replicator execute` passes on in its place."""

from __future__ import annotations

from pglast import ast
from pglast.enums import ObjectType, TransactionStmtKind, VariableSetKind

# Statements whose tag does not depend on what they hold.
_TAGS: dict[type[ast.Node], str] = {
    ast.InsertStmt: "INSERT", ast.UpdateStmt: "UPDATE", ast.DeleteStmt: "DELETE", ast.MergeStmt: "MERGE",
    ast.CopyStmt: "COPY", ast.TruncateStmt: "TRUNCATE TABLE", ast.LockStmt: "LOCK TABLE",
    ast.DoStmt: "DO", ast.CallStmt: "CALL", ast.ExplainStmt: "EXPLAIN", ast.PrepareStmt: "PREPARE",
    ast.ExecuteStmt: "EXECUTE", ast.DeclareCursorStmt: "DECLARE CURSOR", ast.VariableShowStmt: "SHOW",
    ast.ConstraintsSetStmt: "SET CONSTRAINTS", ast.NotifyStmt: "NOTIFY", ast.ListenStmt: "LISTEN",
    ast.UnlistenStmt: "UNLISTEN", ast.LoadStmt: "LOAD", ast.CheckPointStmt: "CHECKPOINT",
    ast.ClusterStmt: "CLUSTER", ast.ReindexStmt: "REINDEX", ast.CommentStmt: "COMMENT",
    ast.SecLabelStmt: "SECURITY LABEL", ast.AlterDefaultPrivilegesStmt: "ALTER DEFAULT PRIVILEGES",
    ast.RefreshMatViewStmt: "REFRESH MATERIALIZED VIEW", ast.AlterSystemStmt: "ALTER SYSTEM",
    ast.DropOwnedStmt: "DROP OWNED", ast.ReassignOwnedStmt: "REASSIGN OWNED",
    ast.CreateStmt: "CREATE TABLE", ast.CreateForeignTableStmt: "CREATE FOREIGN TABLE", ast.ViewStmt: "CREATE VIEW",
    ast.IndexStmt: "CREATE INDEX", ast.CreateSeqStmt: "CREATE SEQUENCE", ast.AlterSeqStmt: "ALTER SEQUENCE",
    ast.CreateSchemaStmt: "CREATE SCHEMA", ast.CreateDomainStmt: "CREATE DOMAIN", ast.AlterDomainStmt: "ALTER DOMAIN",
    ast.CompositeTypeStmt: "CREATE TYPE", ast.CreateEnumStmt: "CREATE TYPE", ast.CreateRangeStmt: "CREATE TYPE",
    ast.AlterEnumStmt: "ALTER TYPE", ast.AlterTypeStmt: "ALTER TYPE", ast.RuleStmt: "CREATE RULE",
    ast.CreateTrigStmt: "CREATE TRIGGER", ast.CreateEventTrigStmt: "CREATE EVENT TRIGGER",
    ast.AlterEventTrigStmt: "ALTER EVENT TRIGGER", ast.CreatePolicyStmt: "CREATE POLICY",
    ast.AlterPolicyStmt: "ALTER POLICY", ast.CreateStatsStmt: "CREATE STATISTICS",
    ast.AlterStatsStmt: "ALTER STATISTICS",
    ast.CreateExtensionStmt: "CREATE EXTENSION", ast.AlterExtensionStmt: "ALTER EXTENSION",
    ast.AlterExtensionContentsStmt: "ALTER EXTENSION", ast.CreatePLangStmt: "CREATE LANGUAGE",
    ast.CreateConversionStmt: "CREATE CONVERSION", ast.CreateCastStmt: "CREATE CAST",
    ast.CreateTransformStmt: "CREATE TRANSFORM", ast.CreateAmStmt: "CREATE ACCESS METHOD",
    ast.CreateOpClassStmt: "CREATE OPERATOR CLASS", ast.CreateOpFamilyStmt: "CREATE OPERATOR FAMILY",
    ast.AlterOpFamilyStmt: "ALTER OPERATOR FAMILY", ast.AlterOperatorStmt: "ALTER OPERATOR",
    ast.AlterCollationStmt: "ALTER COLLATION", ast.AlterTSDictionaryStmt: "ALTER TEXT SEARCH DICTIONARY",
    ast.AlterTSConfigurationStmt: "ALTER TEXT SEARCH CONFIGURATION",
    ast.CreateFdwStmt: "CREATE FOREIGN DATA WRAPPER", ast.AlterFdwStmt: "ALTER FOREIGN DATA WRAPPER",
    ast.CreateForeignServerStmt: "CREATE SERVER", ast.AlterForeignServerStmt: "ALTER SERVER",
    ast.CreateUserMappingStmt: "CREATE USER MAPPING", ast.AlterUserMappingStmt: "ALTER USER MAPPING",
    ast.DropUserMappingStmt: "DROP USER MAPPING", ast.ImportForeignSchemaStmt: "IMPORT FOREIGN SCHEMA",
    ast.CreatePublicationStmt: "CREATE PUBLICATION", ast.AlterPublicationStmt: "ALTER PUBLICATION",
    ast.CreateSubscriptionStmt: "CREATE SUBSCRIPTION", ast.AlterSubscriptionStmt: "ALTER SUBSCRIPTION",
    ast.DropSubscriptionStmt: "DROP SUBSCRIPTION", ast.CreateRoleStmt: "CREATE ROLE", ast.AlterRoleStmt: "ALTER ROLE",
    ast.AlterRoleSetStmt: "ALTER ROLE", ast.DropRoleStmt: "DROP ROLE", ast.CreatedbStmt: "CREATE DATABASE",
    ast.AlterDatabaseStmt: "ALTER DATABASE", ast.AlterDatabaseSetStmt: "ALTER DATABASE",
    ast.AlterDatabaseRefreshCollStmt: "ALTER DATABASE", ast.DropdbStmt: "DROP DATABASE",
    ast.CreateTableSpaceStmt: "CREATE TABLESPACE", ast.AlterTableSpaceOptionsStmt: "ALTER TABLESPACE",
    ast.DropTableSpaceStmt: "DROP TABLESPACE",
}

# How a tag names a kind of object, where not its enum name (OBJECT_FOREIGN_TABLE: FOREIGN TABLE).
_OBJECT_NAMES = {
    ObjectType.OBJECT_ATTRIBUTE: "TYPE", ObjectType.OBJECT_COLUMN: "TABLE", ObjectType.OBJECT_TABCONSTRAINT: "TABLE",
    ObjectType.OBJECT_DOMCONSTRAINT: "DOMAIN", ObjectType.OBJECT_FDW: "FOREIGN DATA WRAPPER",
    ObjectType.OBJECT_FOREIGN_SERVER: "SERVER", ObjectType.OBJECT_LARGEOBJECT: "LARGE OBJECT",
    ObjectType.OBJECT_MATVIEW: "MATERIALIZED VIEW", ObjectType.OBJECT_OPCLASS: "OPERATOR CLASS",
    ObjectType.OBJECT_OPFAMILY: "OPERATOR FAMILY", ObjectType.OBJECT_STATISTIC_EXT: "STATISTICS",
    ObjectType.OBJECT_TSCONFIGURATION: "TEXT SEARCH CONFIGURATION",
    ObjectType.OBJECT_TSDICTIONARY: "TEXT SEARCH DICTIONARY", ObjectType.OBJECT_TSPARSER: "TEXT SEARCH PARSER",
    ObjectType.OBJECT_TSTEMPLATE: "TEXT SEARCH TEMPLATE",
}

# Transaction statements whose tag is not their kind's enum name (TRANS_STMT_COMMIT_PREPARED: COMMIT PREPARED).
_TRANSACTION_TAGS = {TransactionStmtKind.TRANS_STMT_START: "START TRANSACTION",
                     TransactionStmtKind.TRANS_STMT_ROLLBACK_TO: "ROLLBACK",
                     TransactionStmtKind.TRANS_STMT_PREPARE: "PREPARE TRANSACTION"}


def _object(kind: ObjectType | None) -> str:
    """The kind of object as tags name it: 'TABLE', 'MATERIALIZED VIEW'..."""
    if kind is None:
        return "UNKNOWN"
    return _OBJECT_NAMES.get(kind) or kind.name.removeprefix("OBJECT_").replace("_", " ")


def _selects_into(select: ast.SelectStmt) -> bool:
    """SELECT ... INTO, whose INTO a UNION's first SELECT holds."""
    while select.larg is not None:
        select = select.larg
    return select.intoClause is not None


def command_tag(statement: ast.Node) -> str:   # noqa: C901 -- a flat case per kind of statement
    """The tag of a statement's parse tree: 'ALTER TABLE', 'CREATE TABLE AS',
    'SELECT INTO' (which event triggers see as such), 'CREATE INDEX' (also for
    CREATE UNIQUE INDEX), 'TRUNCATE TABLE', 'CREATE ROLE' (for CREATE USER),
    'SELECT' (for VALUES and TABLE too)... 'UNKNOWN' for none."""
    match statement:
        case ast.SelectStmt():
            return "SELECT INTO" if _selects_into(statement) else "SELECT"
        case ast.CreateTableAsStmt(objtype=ObjectType.OBJECT_MATVIEW):
            return "CREATE MATERIALIZED VIEW"
        case ast.CreateTableAsStmt():
            return "SELECT INTO" if statement.is_select_into else "CREATE TABLE AS"
        case ast.CreateFunctionStmt():
            return "CREATE PROCEDURE" if statement.is_procedure else "CREATE FUNCTION"
        case ast.DefineStmt():
            return f"CREATE {_object(statement.kind)}"
        case ast.DropStmt():
            return f"DROP {_object(statement.removeType)}"
        case ast.RenameStmt():  # a column's rename is its relation's
            renamed = statement.renameType
            return f"ALTER {_object(statement.relationType if renamed == ObjectType.OBJECT_COLUMN else renamed)}"
        case ast.AlterTableStmt() | ast.AlterTableMoveAllStmt() | ast.AlterFunctionStmt():
            return f"ALTER {_object(statement.objtype)}"
        case ast.AlterObjectSchemaStmt() | ast.AlterOwnerStmt() | ast.AlterObjectDependsStmt():
            return f"ALTER {_object(statement.objectType)}"
        case ast.GrantStmt():
            return "GRANT" if statement.is_grant else "REVOKE"
        case ast.GrantRoleStmt():
            return "GRANT ROLE" if statement.is_grant else "REVOKE ROLE"
        case ast.TransactionStmt() if statement.kind is not None:
            kind = statement.kind
            return _TRANSACTION_TAGS.get(kind) or kind.name.removeprefix("TRANS_STMT_").replace("_", " ")
        case ast.VariableSetStmt():
            return "RESET" if statement.kind in (VariableSetKind.VAR_RESET, VariableSetKind.VAR_RESET_ALL) else "SET"
        case ast.VacuumStmt():
            return "VACUUM" if statement.is_vacuumcmd else "ANALYZE"
        case ast.DiscardStmt() if statement.target is not None:
            return statement.target.name.replace("_", " ")      # DISCARD_ALL: DISCARD ALL
        case ast.ClosePortalStmt():
            return "CLOSE CURSOR" if statement.portalname else "CLOSE CURSOR ALL"
        case ast.FetchStmt():
            return "MOVE" if statement.ismove else "FETCH"
        case ast.DeallocateStmt():
            return "DEALLOCATE" if statement.name else "DEALLOCATE ALL"
    return _TAGS.get(type(statement), "UNKNOWN")
