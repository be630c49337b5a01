//! Small builders the migrations share.

use sea_orm_migration::prelude::*;

pub fn index<T: IntoIden, C: IntoIden>(
    name: &str,
    table: T,
    columns: impl IntoIterator<Item = C>,
) -> IndexCreateStatement {
    let mut index = Index::create();
    index.name(name).table(table);
    for column in columns {
        index.col(column);
    }
    index.to_owned()
}

pub fn unique_index<T: IntoIden, C: IntoIden>(
    name: &str,
    table: T,
    columns: impl IntoIterator<Item = C>,
) -> IndexCreateStatement {
    index(name, table, columns).unique().to_owned()
}

pub async fn add_column<T: IntoIden + 'static>(
    manager: &SchemaManager<'_>,
    table: T,
    mut column: ColumnDef,
) -> Result<(), DbErr> {
    manager
        .alter_table(
            Table::alter()
                .table(table)
                .add_column(&mut column)
                .to_owned(),
        )
        .await
}
