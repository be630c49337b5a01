//! sea-orm entities: one module per table. Timestamps are epoch milliseconds.

pub mod conversation {
    use sea_orm::entity::prelude::*;

    #[derive(Clone, Debug, PartialEq, DeriveEntityModel)]
    #[sea_orm(table_name = "conversations")]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub id: Uuid,
        pub tenant: String,
        pub principal: String,
        pub agent: String,
        pub title: Option<String>,
        pub created_at: i64,
        /// The newest event sequence number; bumped under this row's lock.
        pub event_seq: i64,
        /// The newest run's number (`runs.seq`); bumped under this row's
        /// lock.
        pub run_seq: i64,
    }

    #[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
    pub enum Relation {}

    impl ActiveModelBehavior for ActiveModel {}
}

pub mod message {
    use sea_orm::entity::prelude::*;

    #[derive(Clone, Debug, PartialEq, DeriveEntityModel)]
    #[sea_orm(table_name = "messages")]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub id: Uuid,
        pub conversation_id: Uuid,
        pub tenant: String,
        pub role: String,
        pub run_id: Option<Uuid>,
        pub client_message_id: Option<String>,
        pub created_at: i64,
        /// The number of the run the message belongs to (`runs.seq`): the
        /// one it started, or the one that wrote it.
        pub run_seq: i64,
        /// Its place among its run's messages: the one that started the run
        /// 0, the reply 1, then steered messages and the reply's later
        /// messages in the order they joined; from
        /// `commit::PENDING_POS` on, steered messages still waiting for
        /// the run's next step boundary, in the order sent.
        pub pos: i64,
    }

    #[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
    pub enum Relation {}

    impl ActiveModelBehavior for ActiveModel {}
}

pub mod part {
    use sea_orm::entity::prelude::*;

    #[derive(Clone, Debug, PartialEq, DeriveEntityModel)]
    #[sea_orm(table_name = "parts")]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub id: Uuid,
        pub message_id: Uuid,
        pub conversation_id: Uuid,
        pub tenant: String,
        pub idx: i32,
        pub kind: String,
        pub state: String,
        pub text: Option<String>,
        pub data: Option<Json>,
        pub created_at: i64,
        pub updated_at: i64,
        /// The run that wrote the part; `None` for a user's message.
        pub run_id: Option<Uuid>,
        /// Text of an attempt that was cut off: shown, never sent to the
        /// model again.
        pub abandoned: bool,
        /// Which step of its run wrote the part.
        pub step: i32,
    }

    #[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
    pub enum Relation {}

    impl ActiveModelBehavior for ActiveModel {}
}

pub mod run {
    use sea_orm::entity::prelude::*;

    #[derive(Clone, Debug, PartialEq, DeriveEntityModel)]
    #[sea_orm(table_name = "runs")]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub id: Uuid,
        pub conversation_id: Uuid,
        pub tenant: String,
        pub principal: String,
        pub agent: String,
        pub trigger_message_id: Uuid,
        pub status: String,
        pub end_cause: Option<String>,
        pub error: Option<Json>,
        pub cancel_requested: bool,
        pub attempt: i32,
        pub max_attempts: i32,
        pub next_attempt_at: Option<i64>,
        pub steps: i32,
        pub input_tokens: i64,
        pub output_tokens: i64,
        #[sea_orm(column_type = "Double")]
        pub cost_usd: f64,
        pub created_at: i64,
        pub started_at: Option<i64>,
        pub ended_at: Option<i64>,
        pub lease_owner: Option<String>,
        pub lease_epoch: i64,
        pub lease_expires_at: Option<i64>,
        pub recoveries: i32,
        /// Milliseconds spent RUNNING before the current claim.
        pub active_ms: i64,
        /// When the current claim began.
        pub claimed_at: Option<i64>,
        /// Which limit or stop condition ended the run, in words.
        pub end_reason: Option<String>,
        /// The run's place in its conversation (1, 2, ...), allocated under
        /// the conversation's lock: runs execute, and show, in this order,
        /// whatever the clocks of the processes that made their ids.
        pub seq: i64,
        /// Why a cancel was asked of the worker holding the run, when not
        /// by `cancelRun`: `INTERRUPTED` (a message sent with `INTERRUPT`).
        /// The run ends with this cause.
        pub cancel_cause: Option<String>,
        /// How many messages wait to steer the run at its next step
        /// boundary (`onActiveRun: STEER`).
        pub steering: i32,
        /// Whether messages ever joined the run at a step boundary: its end
        /// then looks for those no answer of the model followed.
        pub steered: bool,
    }

    #[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
    pub enum Relation {}

    impl ActiveModelBehavior for ActiveModel {}
}

pub mod event {
    use sea_orm::entity::prelude::*;

    #[derive(Clone, Debug, PartialEq, DeriveEntityModel)]
    #[sea_orm(table_name = "events")]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub conversation_id: Uuid,
        #[sea_orm(primary_key, auto_increment = false)]
        pub seq: i64,
        pub tenant: String,
        pub run_id: Option<Uuid>,
        pub kind: String,
        pub payload: Json,
        pub created_at: i64,
    }

    #[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
    pub enum Relation {}

    impl ActiveModelBehavior for ActiveModel {}
}

pub mod run_audit {
    use sea_orm::entity::prelude::*;

    /// One row per ended run: how it ended and what it used.
    #[derive(Clone, Debug, PartialEq, DeriveEntityModel)]
    #[sea_orm(table_name = "run_audit")]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub run_id: Uuid,
        pub tenant: String,
        pub conversation_id: Uuid,
        pub status: String,
        pub end_cause: String,
        pub steps: i32,
        pub input_tokens: i64,
        pub output_tokens: i64,
        #[sea_orm(column_type = "Double")]
        pub cost_usd: f64,
        pub active_ms: i64,
        pub recoveries: i32,
        pub ended_at: i64,
    }

    #[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
    pub enum Relation {}

    impl ActiveModelBehavior for ActiveModel {}
}

pub mod operator_action {
    use sea_orm::entity::prelude::*;

    /// What an operator did across tenants, with their note.
    #[derive(Clone, Debug, PartialEq, DeriveEntityModel)]
    #[sea_orm(table_name = "operator_actions")]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub id: Uuid,
        pub operator: String,
        /// The `iss` of the operator's token, when it had one.
        pub issuer: Option<String>,
        pub action: String,
        pub tenant: String,
        pub run_id: Option<Uuid>,
        pub tool_call_id: Option<Uuid>,
        pub note: String,
        pub detail: Json,
        pub created_at: i64,
    }

    #[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
    pub enum Relation {}

    impl ActiveModelBehavior for ActiveModel {}
}

pub mod summary {
    use sea_orm::entity::prelude::*;

    /// A summary standing in for a conversation's messages up to
    /// `through_message_id` in the model's history.
    #[derive(Clone, Debug, PartialEq, DeriveEntityModel)]
    #[sea_orm(table_name = "summaries")]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub id: Uuid,
        pub conversation_id: Uuid,
        pub tenant: String,
        pub run_id: Uuid,
        pub through_message_id: Uuid,
        pub messages_compacted: i32,
        pub text: String,
        pub input_tokens: i64,
        pub output_tokens: i64,
        pub created_at: i64,
        /// The number of the run that made it (`runs.seq`).
        pub run_seq: i64,
    }

    #[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
    pub enum Relation {}

    impl ActiveModelBehavior for ActiveModel {}
}

pub mod tool_call {
    use sea_orm::entity::prelude::*;

    /// A tool call the model made, and the idempotency record of its effect.
    #[derive(Clone, Debug, PartialEq, DeriveEntityModel)]
    #[sea_orm(table_name = "tool_calls")]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub id: Uuid,
        pub tenant: String,
        pub conversation_id: Uuid,
        pub run_id: Uuid,
        pub part_id: Uuid,
        /// The run's step that asked for it (0-based).
        pub step: i32,
        /// Its place in the step's batch.
        pub idx: i32,
        pub provider_call_id: String,
        pub name: String,
        pub model_input: Json,
        pub input: Option<Json>,
        pub status: String,
        pub outcome: Option<String>,
        pub attempt: i32,
        pub output: Option<Json>,
        pub full_output: Option<String>,
        pub output_truncated: bool,
        pub idempotency_key: String,
        pub created_at: i64,
        pub started_at: Option<i64>,
        pub ended_at: Option<i64>,
    }

    #[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
    pub enum Relation {}

    impl ActiveModelBehavior for ActiveModel {}
}

pub mod interaction {
    use sea_orm::entity::prelude::*;

    /// What a run asks of a person, resolved once.
    #[derive(Clone, Debug, PartialEq, DeriveEntityModel)]
    #[sea_orm(table_name = "interactions")]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub id: Uuid,
        pub tenant: String,
        pub conversation_id: Uuid,
        pub run_id: Uuid,
        pub tool_call_id: Uuid,
        pub part_id: Uuid,
        pub kind: String,
        pub status: String,
        /// Question specs, or what an approval would run.
        pub request: Json,
        /// Answers, or the decision.
        pub resolution: Option<Json>,
        pub resolved_by: Option<String>,
        pub created_at: i64,
        pub expires_at: i64,
        pub resolved_at: Option<i64>,
        /// When a worker took the resolution into its run.
        pub claimed_at: Option<i64>,
    }

    #[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
    pub enum Relation {}

    impl ActiveModelBehavior for ActiveModel {}
}

pub mod grant {
    use sea_orm::entity::prelude::*;

    /// A standing permission to run a gated tool without asking.
    #[derive(Clone, Debug, PartialEq, DeriveEntityModel)]
    #[sea_orm(table_name = "grants")]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub id: Uuid,
        pub tenant: String,
        pub scope: String,
        pub conversation_id: Option<Uuid>,
        pub principal: Option<String>,
        pub tool: String,
        pub interaction_id: Uuid,
        pub created_at: i64,
    }

    #[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
    pub enum Relation {}

    impl ActiveModelBehavior for ActiveModel {}
}

pub mod connection {
    use sea_orm::entity::prelude::*;

    /// A principal's account at another service. The tokens are sealed.
    #[derive(Clone, PartialEq, DeriveEntityModel)]
    #[sea_orm(table_name = "connections")]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub id: Uuid,
        pub tenant: String,
        pub principal: String,
        pub provider: String,
        /// Granted scopes, a JSON array of strings.
        pub scopes: Json,
        pub access_token: String,
        pub refresh_token: Option<String>,
        /// The key that sealed the tokens.
        pub key_id: String,
        pub expires_at: Option<i64>,
        pub created_at: i64,
        pub updated_at: i64,
    }

    // Sealed tokens are still not for logs.
    impl std::fmt::Debug for Model {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("Connection")
                .field("tenant", &self.tenant)
                .field("principal", &self.principal)
                .field("provider", &self.provider)
                .field("scopes", &self.scopes)
                .field("expires_at", &self.expires_at)
                .finish_non_exhaustive()
        }
    }

    #[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
    pub enum Relation {}

    impl ActiveModelBehavior for ActiveModel {}
}

pub mod consent {
    use sea_orm::entity::prelude::*;

    /// An OAuth authorization request on its way, found by its `state`.
    #[derive(Clone, PartialEq, DeriveEntityModel)]
    #[sea_orm(table_name = "consents")]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub state: String,
        pub interaction_id: Uuid,
        pub tenant: String,
        pub principal: String,
        pub provider: String,
        /// The sealed PKCE verifier.
        pub verifier: String,
        pub key_id: String,
        pub created_at: i64,
    }

    impl std::fmt::Debug for Model {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("Consent")
                .field("interaction_id", &self.interaction_id)
                .field("provider", &self.provider)
                .finish_non_exhaustive()
        }
    }

    #[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
    pub enum Relation {}

    impl ActiveModelBehavior for ActiveModel {}
}
